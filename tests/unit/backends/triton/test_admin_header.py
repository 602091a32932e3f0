"""--admin-header: its parsing and the Triton flags it adds (backends.triton.launch_options, server_binary)."""
import argparse
from pathlib import Path

import pytest

from backends.triton.launch_options import admin_header_option
from backends.triton.ports import ServerPorts
from backends.triton.server_binary import SHM_HEADER, restricted_api_flags, server_command


def test_a_header_restricts_the_log_trace_and_shared_memory_apis_over_http_and_grpc():
    rule = "logging,trace,shared-memory:x-admin=s3cret"
    assert restricted_api_flags(("x-admin", "s3cret")) == [f"--http-restricted-api={rule}",
                                                           f"--grpc-restricted-protocol={rule}"]
    command = server_command(Path("tritonserver"), Path("backends"), Path("repo"), ServerPorts(), 1 << 20, 10,
                             ("x-admin", "s3cret"))
    assert command[-2:] == restricted_api_flags(("x-admin", "s3cret"))


def test_without_a_header_shared_memory_alone_asks_for_a_value_nobody_is_told():
    http, grpc = restricted_api_flags(None)
    secret = http.removeprefix(f"--http-restricted-api=shared-memory:{SHM_HEADER}=")
    assert len(secret) == 32 and grpc == f"--grpc-restricted-protocol=shared-memory:{SHM_HEADER}={secret}"
    assert restricted_api_flags(None)[0] != http  # made for each command
    command = server_command(Path("t"), Path("b"), Path("r"), ServerPorts(), 1 << 20, 10)
    assert [arg.partition("=")[0] for arg in command[-2:]] == ["--http-restricted-api", "--grpc-restricted-protocol"]


def test_the_name_is_lower_cased_as_grpc_sends_it():
    assert admin_header_option("X-Admin=s3cret") == ("x-admin", "s3cret")


@pytest.mark.parametrize("text", ["x-admin", "=v", "x admin=v", "x-admin=", "x-admin=a,b", "x-admin=a:b",
                                  "x-admin=a=b", "x-admin=a b", "-x=v", "x-admin=\u00e9"])
def test_what_the_flag_cannot_carry_is_a_usage_error(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
        admin_header_option(text)
