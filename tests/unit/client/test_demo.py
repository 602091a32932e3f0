"""python -m client.demo (make demo) with a port another server holds: its message and exit status 2, no
traceback and no server started."""
import socket

from backends.triton.ports import ServerPorts
from client.demo import main


def test_a_taken_port_exits_2_naming_it(capsys):
    ports = ServerPorts.unused()
    with socket.socket() as holder:  # as `make serve` would hold it
        holder.bind((ports.address, ports.http))
        holder.listen()
        status = main(["--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
                       "--metrics-port", str(ports.metrics)])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert f"error: http port 127.0.0.1:{ports.http} is not free" in err and "choose another with --http-port" in err
