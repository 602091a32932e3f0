"""The PATH tritonserver gets (backends/triton/server_binary.py, ``first_on_path``): this Python's folder first, for
the stub to find its site-packages, listed once, and no empty entry (the working folder)."""
from __future__ import annotations

import pytest

from backends.triton.server_binary import first_on_path


@pytest.mark.parametrize("path, expected", [
    ("/usr/bin:/bin", "/v/bin:/usr/bin:/bin"),
    ("/v/bin:/usr/bin", "/v/bin:/usr/bin"),          # an activated venv: not twice (a fresh user's --render)
    ("/usr/bin:/v/bin", "/v/bin:/usr/bin"),
    ("", "/v/bin"),                                  # not "/v/bin:", whose empty entry is the working folder
    ("/usr/bin::/bin:", "/v/bin:/usr/bin:/bin"),
])
def test_this_pythons_folder_comes_first_once(path, expected):
    assert first_on_path("/v/bin", path) == expected
