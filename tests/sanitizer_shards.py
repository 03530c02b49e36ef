"""Runs a pytest selection under compute-sanitizer in parallel shards (tests/gpu_reliability.sh).

    python tests/sanitizer_shards.py --shards N --log-dir DIR SANITIZER... -- PYTEST_ARGS...

Collects the test ids that PYTEST_ARGS select, deals them round-robin into N shards (the
collection order interleaves the files, so each shard gets a like mix) and runs each shard as
`SANITIZER... python -m pytest IDS...` at the same time, logging to DIR/shard-K.log. A sanitizer
spends most of its time on the host (intercepting every allocation and launch), so the shards
run side by side on one GPU. Prints each shard's sanitizer and pytest summaries, then one
combined `ERROR SUMMARY: E errors` line and `P passed ... in Ts`; exits non-zero if a shard
failed, found an error or printed no summary.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time


def collect(pytest_args):
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider"] + pytest_args,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ids = [line.strip() for line in run.stdout.splitlines() if "::" in line]
    if run.returncode not in (0, 5) or not ids:  # 5: nothing selected
        sys.exit(f"collection failed or selected nothing (rc {run.returncode}):\n{run.stdout}")
    return ids


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if "--" not in args.rest:
        parser.error("give SANITIZER... -- PYTEST_ARGS...")
    cut = args.rest.index("--")
    sanitizer, pytest_args = args.rest[:cut], args.rest[cut + 1:]
    ids = collect(pytest_args)
    shards = [ids[k::args.shards] for k in range(args.shards) if ids[k::args.shards]]
    print(f"{len(ids)} tests in {len(shards)} shards", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    start = time.time()
    procs = []
    for k, shard in enumerate(shards):
        log = open(os.path.join(args.log_dir, f"shard-{k}.log"), "w")
        cmd = sanitizer + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + shard
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True), log))

    def stop(*_):
        for proc, _ in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.exit(130)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    errors, passed, failed, ok, summaries = 0, 0, 0, True, 0
    for k, (proc, log) in enumerate(procs):
        rc = proc.wait()
        log.close()
        text = open(log.name).read()
        summary = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
        result = re.findall(r"^=*\s*(.*(?:passed|failed|error).* in [0-9.]+s.*?)=*$", text,
                            re.MULTILINE)
        counts = dict((w, int(n)) for n, w in re.findall(r"(\d+) (passed|failed)", result[-1])) \
            if result else {}
        passed += counts.get("passed", 0)
        failed += counts.get("failed", 0)
        if summary:
            errors += int(summary[-1])
            summaries += 1
        ok &= rc == 0 and bool(summary) and bool(result)
        print(f"shard {k}: rc {rc}, {len(shards[k])} tests, "
              f"{result[-1].strip() if result else 'no pytest summary'}, "
              f"{('sanitizer errors: ' + summary[-1]) if summary else 'no sanitizer summary'}",
              flush=True)
    elapsed = time.time() - start
    print(f"{passed} passed, {failed} failed in {elapsed:.1f}s")
    if summaries == len(procs):  # (else the step reports a missing summary)
        print(f"ERROR SUMMARY: {errors} errors")
    sys.exit(0 if ok and failed == 0 else 1)


if __name__ == "__main__":
    main()
