"""Load test of `visar serve` on 127.0.0.1, bounded in requests and time (docs/SERVING.md's figures).

    OMP_NUM_THREADS=2 python tools/load_test.py --model visar-tiny-c2i --out load.json

For each server setting (method x slots) it starts `visar serve` on a free port, sends a warm-up, then
--requests requests of one image each from --clients concurrent clients, and reports images/s, p50 /
p95 latency and the statuses; `ar` is AR's law at a token a pass in a running batch (mc-sjd at
budget 1: `ar` itself decodes a fixed list). Then, on the default setting at --slots:
- faults: the same load with one client that leaves mid-request and 5 malformed requests mixed in;
- overload: --overload clients at once, one request each, against a queue of --overload / 2.
Every accepted request must be answered once: `lost` counts those that were not; any 5xx is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

SETTINGS = {"auto": [], "mc-sjd": ["--method", "mc-sjd"], "ar": ["--method", "mc-sjd", "--opt", "budget=1"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(model: str, slots: int, flags: list[str], max_queue: int, seconds: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "visar", "serve", "--model", model, "--slots", str(slots), "--port", str(port)]
    command += ["--max-queue", str(max_queue), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"visar serve exited: {process.stdout.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.read() == b"ok":
                    return process, url
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit(f"visar serve did not start within {seconds:.0f} s")


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def post(url: str, body: bytes, timeout: float) -> tuple[int, str | None]:
    """-> (status, the method the server named for the image)."""
    request = urllib.request.Request(
        f"{url}/v1/images/generations", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = json.loads(response.read()).get("data")
            return (response.status, data[0]["visar"]["method"]) if data else (-1, None)  # -1: no image
    except urllib.error.HTTPError as err:
        return err.code, None
    except OSError:
        return 0, None  # no answer: lost


def leave_mid_request(url: str, body: bytes):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.2)


def load(url: str, requests: int, clients: int, classes: int, timeout: float, extra: list[bytes] = ()) -> dict:
    """`requests` one-image requests (class k % classes, seed k) from `clients` threads, and `extra`
    bodies mixed in -> images/s over the good requests, latency percentiles and statuses."""
    bodies = [json.dumps({"class_label": k % classes, "seed": 1000 + k}).encode() for k in range(requests)]
    work = [(body, True) for body in bodies] + [(body, False) for body in extra]
    work = work[::2] + work[1::2]  # the extra ones spread through the load
    lock, latencies, statuses, answered, methods = threading.Lock(), [], {}, [], set()

    def client():
        while True:
            with lock:
                if not work:
                    return
                body, counted = work.pop(0)
            started = time.monotonic()
            status, method = post(url, body, timeout)
            with lock:
                methods.update([method] if method else [])
                statuses[status] = statuses.get(status, 0) + 1
                if counted:
                    answered.append(status)
                    if status == 200:
                        latencies.append(time.monotonic() - started)

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    latencies.sort()
    return {
        "images_per_s": round(len(latencies) / seconds, 3),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "methods": sorted(methods),
        "lost": sum(status in (0, -1) for status in answered),
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="visar-tiny-c2i")
    parser.add_argument("--classes", type=int, default=40, help="class labels the requests cycle through")
    parser.add_argument("--settings", default="auto,mc-sjd,ar", help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=16, help="requests before the timed ones")
    parser.add_argument("--overload", type=int, default=64, help="clients at once against a queue of half as many")
    parser.add_argument("--timeout", type=float, default=300, help="a request's client-side limit in seconds")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args(argv)
    results = {"model": args.model, "threads": os.environ.get("OMP_NUM_THREADS"), "runs": []}
    malformed = [b'{"class_label": 1,', b'{"class_label": 1, "quality": "hd"}', b'{"seed": -2, "class_label": 1}']
    malformed += [b'{"prompt": "a cat"}', b'{"class_label": 1, "n": 99}']
    for name in args.settings.split(","):
        for slots in (args.slots, 1):
            process, url = start(args.model, slots, SETTINGS[name], max_queue=args.requests, seconds=600)
            load(url, args.warmup, args.clients, args.classes, args.timeout)
            run = {
                "setting": name,
                "slots": slots,
                **load(url, args.requests, args.clients, args.classes, args.timeout),
            }
            if name == "auto" and slots == args.slots:
                body = json.dumps({"class_label": 3, "n": 4}).encode()
                leaver = threading.Thread(target=leave_mid_request, args=(url, body))
                leaver.start()
                run["faults"] = load(url, args.requests, args.clients, args.classes, args.timeout, malformed)
                leaver.join()
            run["exit_code"] = stop(process)
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
    process, url = start(args.model, args.slots, [], max_queue=args.overload // 2, seconds=600)
    overload = load(url, args.overload, args.overload, args.classes, args.timeout)
    results["overload"] = {"clients": args.overload, "max_queue": args.overload // 2, **overload}
    results["overload"]["exit_code"] = stop(process)
    print(json.dumps(results["overload"]), flush=True)
    for name in args.settings.split(","):
        one = {run["slots"]: run["images_per_s"] for run in results["runs"] if run["setting"] == name}
        print(
            f"{name}: {one[args.slots]} images/s at {args.slots} slots, {one[1]} at 1: {one[args.slots] / one[1]:.2f}x"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
