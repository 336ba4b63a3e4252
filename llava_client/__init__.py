"""Client for the stateful LLaVA endpoint on SageMaker (or the local endpoint): boto3 only."""

from llava_client.errors import LlavaError, SessionGone, StreamGap
from llava_client.session import Answer, LlavaClient, Session, Turn

__all__ = ["Answer", "LlavaClient", "LlavaError", "Session", "SessionGone", "StreamGap", "Turn"]
