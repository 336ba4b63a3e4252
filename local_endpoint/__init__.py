"""A small SageMaker-compatible endpoint for development: sticky sessions over local TorchServes.

Speaks enough of the sagemaker-runtime REST API (``InvokeEndpoint``,
``InvokeEndpointWithResponseStream``, session headers, error bodies, event-stream framing)
that unmodified boto3 code runs against it through ``endpoint_url=``. Standard library only,
no torch: it forwards bytes. Not a production router (see docs/client.md §The local endpoint).
"""
