"""HTTP plumbing shared by asyncrl's servers and their clients: bearer auth, JSON errors, body limits, and a
JSON client whose transport failures are one exception type."""

from asyncrl.http.client import JSONClient, Reply, TransportError
from asyncrl.http.server import (
    BearerAuth, HTTPError, bad_request, check_token, error_response, json_endpoint, parse_json_object, read_body,
    read_json_object,
)

__all__ = ["BearerAuth", "HTTPError", "JSONClient", "Reply", "TransportError", "bad_request", "check_token",
           "error_response", "json_endpoint", "parse_json_object", "read_body", "read_json_object"]
