"""`pip install .` gives the client package and its console command, which runs from any folder (the end-to-end
suite asks a server with it: tests/e2e/test_ops.py); it requires tritonclient and numpy only, the server's packages
being the extra `server`."""
import email
import re
import subprocess
import sys
import zipfile

from backends.triton.launcher import REPO_ROOT
from tests.install import build_wheel, environment, install

SERVER_ONLY = ("torch", "transformers", "tokenizers", "av", "PIL", "yaml", "fastapi", "uvicorn", "uvloop", "httptools",
               "sse_starlette", "httpx", "backends", "orchestrator", "flashcodec")  # the extra `server`, our server


def test_the_wheel_holds_the_client_and_its_command_which_runs_from_any_folder(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(info))
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert {"client/__init__.py", "client/__main__.py", "client/api.py", "client/http_stream.py"} <= names
    assert "[console_scripts]\nunifiedserve-client = client.__main__:main" in entry_points
    requires = metadata.get_all("Requires-Dist")
    plain = {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert plain == {"numpy", "tritonclient"}  # what client.api imports
    assert any(r.startswith("torch") and 'extra == "server"' in r for r in requires)
    installs = re.findall(r"^RUN .*pip install (\S+)", (REPO_ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert installs == ['".[server]"']  # the image is a server: the extra, not the client alone

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


def test_the_clients_command_line_runs_with_the_servers_packages_unimportable():
    blocker = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {SERVER_ONLY!r}:\n"
        "            raise ImportError(name + ' is the server\\'s')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import client.api, client.http_stream\n"
        "sys.argv = ['unifiedserve-client', '--help']\n"
        "from client.__main__ import main\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", blocker], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: unifiedserve-client ")
