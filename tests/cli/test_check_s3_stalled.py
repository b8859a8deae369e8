"""An S3 endpoint that accepts connections but answers nothing (a real ``rclone serve s3`` stopped
with SIGSTOP), with no credentials configured: when the credential chain fails first (its error
names the instance-metadata host), the endpoint is named unreachable, not "auth failed (no
credentials)" — a TCP connect alone (the kernel accepts it for a stopped process) said it answered."""

from __future__ import annotations

from kvtier.core.tiers.s3.client import describe_failure, endpoint_answers
from kvtier.core.tiers.s3.settings import S3Settings
from tests.redis_servers import free_port

NO_CREDENTIALS = ("Generic S3 error: Error getting credentials: error sending request for url "
                  "(http://169.254.169.254/latest/api/token)")
"""What obstore says when the AWS chain ends at the instance-metadata endpoint (its message's start)."""


def settings(endpoint: str) -> S3Settings:
    return S3Settings(s3_bucket="kvtier", s3_endpoint_url=endpoint, s3_allow_http=True)


def test_a_stalled_endpoint_without_credentials_is_unreachable(s3_factory):
    server = s3_factory()
    assert endpoint_answers(settings(server.url), 2.0) is None
    assert describe_failure(RuntimeError(NO_CREDENTIALS), settings(server.url), 2.0)[0] == "auth failed"
    server.pause()
    why = endpoint_answers(settings(server.url), 0.5)
    assert why == ("the endpoint accepted the connection but did not answer an HTTP request within 0.5 s (a stalled "
                   "server, or not an S3 endpoint)")
    assert describe_failure(RuntimeError(NO_CREDENTIALS), settings(server.url), 0.5) == (
        "unreachable", f"{why}; no credentials are set either")


def test_a_closed_port_is_unreachable():
    closed = settings(f"http://127.0.0.1:{free_port()}")
    assert endpoint_answers(closed, 0.5) == "nothing accepts connections at the endpoint"
    assert describe_failure(RuntimeError(NO_CREDENTIALS), closed, 0.5)[0] == "unreachable"
