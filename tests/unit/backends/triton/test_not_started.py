"""What the launcher says when tritonserver did not start (TritonServer._not_started)."""
from backends.triton.launcher import TritonServer


def test_with_the_log_on_stdout_it_points_there_instead_of_an_empty_tail():
    server = TritonServer(log_to_stdout=True)
    assert server._not_started("tritonserver exited with 1") == (
        "tritonserver exited with 1 (each model's reason is in the server log above)")


def test_with_a_log_file_it_ends_with_the_logs_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("parameter default_max_tokens must be a positive integer, got 0\n")
    message = TritonServer(log_path=log)._not_started("tritonserver exited with 1")
    assert message.startswith("tritonserver exited with 1") and message.endswith(
        "--- end of the log:\nparameter default_max_tokens must be a positive integer, got 0\n")
