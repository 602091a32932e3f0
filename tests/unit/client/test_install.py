"""`pip install .` gives the client package and its console command, which runs from any folder (the end-to-end
suite asks a server with it: tests/e2e/test_ops.py)."""
import email
import subprocess
import sys
import zipfile

from tests.install import build_wheel, environment, install


def test_the_wheel_holds_the_client_and_its_command_which_runs_from_any_folder(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(info))
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert {"client/__init__.py", "client/__main__.py", "client/api.py", "client/http_stream.py"} <= names
    assert "[console_scripts]\nunifiedserve-client = client.__main__:main" in entry_points
    requires = " ".join(metadata.get_all("Requires-Dist"))
    assert "tritonclient" in requires and "numpy" in requires  # what client.api imports

    site = install(wheel, tmp_path / "site")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = environment(site)  # the installed copy first; its dependencies are this interpreter's
    where = subprocess.run([sys.executable, "-c", "import client.api; print(client.api.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(site / "client" / "api.py")
    shown = subprocess.run([str(site / "bin" / "unifiedserve-client"), "--help"], cwd=elsewhere, env=env,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: unifiedserve-client ")
