"""`ksow demo`: a worker, a sample publisher and a live subscriber, so a newcomer sees the SOW work."""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console

from processor.client.sow_client import Client
from processor.topology import load_topology

console = Console(highlight=False)
STYLE = {"sow": "cyan", "insert": "green", "update": "yellow", "delete": "red", "expire": "magenta", "evict": "red", "oof": "blue"}


def _publisher(client: Client, topic: str, stop: threading.Event) -> None:
    """Full publishes, delta publishes, a short-lived record and a delete, over and over."""
    rnd = random.Random(7)
    customers = ["alice", "bob", "carol"]

    def open_order(order: int) -> None:
        client.publish(topic, {"order_id": order, "customer": rnd.choice(customers), "status": "open", "qty": rnd.randrange(100, 2000), "px": {"limit": 100.0}})

    # Every order exists before its first delta: a delta on a missing record becomes the record
    # (AMPS rules), which on screen looks like a delta applied before its record.
    for order in range(1, 6):
        open_order(order)
    client.flush()
    n = 0
    while not stop.is_set():
        n += 1
        order = n % 5 + 1
        step = n % 4
        if step == 1:
            open_order(order)
        elif step == 2:
            client.publish(topic, {"order_id": order, "qty": rnd.randrange(100, 2000), "px": {"last": round(rnd.uniform(99, 101), 2)}}, delta=True)
        elif step == 3:
            client.publish(topic, {"order_id": 100 + n, "customer": "dave", "status": "open", "qty": 1}, expiration="3s")
        else:
            client.publish(topic, {"order_id": order, "status": "filled"}, delta=True)
            if n % 12 == 0:
                client.delete(topic, data={"order_id": order})
                open_order(order)  # re-opened, so the next delta has a record to update
        client.flush()
        stop.wait(1.0)


def run_demo(bootstrap: str, topology_path: str | None, duration: float) -> None:
    topology = load_topology(topology_path)
    topic = topology.sow[0].topic
    data_dir = Path(tempfile.mkdtemp(prefix="ksow-demo-"))
    args = [sys.executable, "-m", "processor.cli", "up", "--bootstrap", bootstrap, "--group", f"ksow-demo-{uuid.uuid4().hex[:6]}",
            "--data-dir", str(data_dir), "--loglevel", "warning"]
    if topology_path:
        args += ["--topology", topology_path]
    log = open(data_dir / "worker.log", "wb")
    worker = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    console.print(f"[bold]ksow demo[/]: worker for [bold]{topic}[/] starting (log {data_dir / 'worker.log'})")
    client = Client(bootstrap, topology)
    stop = threading.Event()
    publisher = threading.Thread(target=_publisher, args=(client, topic, stop), daemon=True)
    try:
        _wait_for_topics(client, topic, worker)
        publisher.start()
        console.print(f"publishing sample orders (full and delta publishes, in order) to [bold]{topic}[/]; "
                      f"subscribed with sow_and_delta_subscribe (oof) to the SOW of {topic}\n")
        deadline = time.monotonic() + duration if duration else None
        with contextlib.closing(client.subscribe(topic, sow=True, delta=True, oof=True, timeout=5.0 if deadline else None)) as events:
            for event in events:
                op = event["op"]
                extra = f" ({event['reason']})" if "reason" in event else ""
                expiry = f"  expires_at={event['expires_at']}" if "expires_at" in event else ""
                console.print(f"[{STYLE.get(op, 'white')}]{op:>7}[/]{extra} key={event.get('sow_key')} {event['record']}{expiry}")
                if deadline and time.monotonic() > deadline:
                    break
        console.print("\n[bold]current SOW[/] (ksow query):")
        for entry in client.query(topic):
            console.print(f"  {entry.sow_key}: {entry.record}")
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join(10)  # its last publish is flushed before the client closes
        client.close()
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()


def _wait_for_topics(client: Client, topic: str, worker: subprocess.Popen, timeout: float = 120) -> None:
    from processor.kafka.clients import make_admin

    admin = make_admin(client.bootstrap)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker exited with {worker.returncode}; see its log")
        if f"{topic}.sow" in admin.list_topics(timeout=10).topics:
            return
        time.sleep(0.5)
    raise SystemExit("the worker did not create its topics in time")
