"""`python -m lorafaas.backbone_daemon NAME --device cpu --home DIR`: a daemon in the foreground.

What the platform and the benchmarks start as a process (without the CLI's imports); `lorafaas backbone serve` is
the same for people. Prints the socket path on stdout once it serves; logs lifecycle at INFO on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

# The daemon's one compute is the shared base pass (a CPU daemon): its OpenMP threads must sleep between products, not
# spin on the cores the functions' processes compute on meanwhile (measured: 34.4 against 28.1 tokens/s, 8 functions).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lorafaas.config import LorafaasConfig
from lorafaas.errors import ClientError, LorafaasError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorafaas.backbone_daemon", description=__doc__)
    parser.add_argument("backbone")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--home", default=None, help="state directory (default: $LORAFAAS_HOME or ~/.lorafaas)")
    parser.add_argument("--lease-ttl", type=float, default=None, help="reap leases without a heartbeat this long")
    parser.add_argument("--reap-interval", type=float, default=0.5)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--adopt-fd", type=int, default=None, help="a predecessor's sealed segment (supervisor's)")
    parser.add_argument("--cpu-linear", default=None,
                        help="kernel of linear products on a CPU: auto (weights packed for oneDNN where torch can, "
                             "else measured at load), packed, torch or onednn "
                             "(default: $LORAFAAS_CPU_LINEAR, else auto)")
    parser.add_argument("--status-fd", type=int, default=None, help="report a start-up error here (msgpack)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from lorafaas.backbone_daemon.server import serve
    from lorafaas.protocols.daemon_config import DaemonConfig
    from lorafaas.protocols.daemon_messages import ErrorReply

    def ready(paths) -> None:
        print(paths.socket, flush=True)
        if args.status_fd is not None:
            os.close(args.status_fd)  # serving: nothing to report
            args.status_fd = None

    try:
        config = DaemonConfig(
            home=LorafaasConfig.from_env(args.home).home,
            backbone=args.backbone,
            device=args.device,
            lease_ttl_s=args.lease_ttl,
            reap_interval_s=args.reap_interval,
            adopt_fd=args.adopt_fd,
            cpu_linear=args.cpu_linear,
        )
        serve(config, on_ready=ready)
    except LorafaasError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if args.status_fd is not None:  # tell the supervisor what failed, typed
            os.write(args.status_fd, msgspec.msgpack.encode(ErrorReply(code=exc.code, message=exc.message)))
        return 2 if isinstance(exc, ClientError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
