"""A faithful stand-in for the client class of the project's seed documents.

It is what chatbot backends already run, so it must work unmodified (but for ``endpoint_url``):
it picks its own session id, opens with ``SessionId="NEW_SESSION"`` and that id in
``extSessionID``, then sends its own id as ``SessionId``; it asks with ``sampling_params`` /
``max_new_token`` and reads ``generation.text``. Do not "fix" it: its quirks are the point.
"""

import json
import uuid

import boto3


class LlavaChatSession:
    def __init__(self, endpoint_name, region_name="us-east-1", endpoint_url=None):
        self.endpoint_name = endpoint_name
        self.runtime = boto3.client(
            "sagemaker-runtime", region_name=region_name, endpoint_url=endpoint_url
        )
        self.session_id = None

    def start(self, image_url):
        self.session_id = "chat-" + uuid.uuid4().hex
        body = {"requestType": "NEW_SESSION", "extSessionID": self.session_id}
        body["image"] = {"url": image_url}
        response = self.runtime.invoke_endpoint(
            EndpointName=self.endpoint_name,
            ContentType="application/json",
            SessionId="NEW_SESSION",
            Body=json.dumps(body),
        )
        return response.get("NewSessionId")

    def ask(self, question, max_new_token=64):
        body = {
            "requestType": "SESSION",
            "inputs": question,
            "sampling_params": {"max_new_token": max_new_token},
        }
        response = self.runtime.invoke_endpoint(
            EndpointName=self.endpoint_name,
            ContentType="application/json",
            SessionId=self.session_id,
            Body=json.dumps(body),
        )
        return json.loads(response["Body"].read())["generation"]["text"]

    def end(self):
        response = self.runtime.invoke_endpoint(
            EndpointName=self.endpoint_name,
            ContentType="application/json",
            SessionId=self.session_id,
            Body=json.dumps({"requestType": "CLOSE_SESSION"}),
        )
        return response.get("ClosedSessionId")
