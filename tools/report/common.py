"""Shared by the report scripts: reading the JSON the benchmarks write, and small helpers.

Every benchmark in the project writes records (one dict per measured point), but in three
shapes: JSON lines (`ioattn bench`), a dict holding lists of records plus metadata
(bench/peer_bench.py, traffic.json), or a CSV (ioattn_sm90_check --csv, peer_sdpa.py --csv).
load_records() reads all of them the same way.
"""
import csv
import json
import os
import subprocess
import time


def load_records(path, list_key=None):
    """(meta, records) from a JSON-lines file, a JSON list, a JSON dict of lists, or a CSV.

    meta: the dict's scalar fields (date, device, command, ...), {} otherwise. records: the list
    under list_key, or (without list_key) every list of dicts in the dict, concatenated.
    A missing or empty file gives ({}, []); a malformed one raises ValueError naming the file.
    """
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return {}, []
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            return {}, [dict(r) for r in csv.DictReader(f)]
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is None:  # JSON lines
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        return {}, records
    if isinstance(data, list):
        return {}, [r for r in data if isinstance(r, dict)]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected JSON records, got {type(data).__name__}")
    meta = {k: v for k, v in data.items() if not isinstance(v, (list, dict))}
    if list_key is not None:
        return meta, [r for r in data.get(list_key, []) if isinstance(r, dict)]
    records = []
    for v in data.values():
        if isinstance(v, list):
            records += [r for r in v if isinstance(r, dict)]
    return meta, records


def num(x):
    """float(x), or None for None / '' / 'null' / something that is not a number."""
    if x is None or x == "" or x == "null":
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def sm90_grid_rows(records):
    """The bf16 forward grid's rows of an `ioattn_sm90_check --csv` file (impl ioattn_sm90): the
    same file also holds the fp8 comparison's rows (ioattn_sm90_fp8, _prepass, _bf16_vs_fp8)."""
    return [r for r in records if r.get("impl") == "ioattn_sm90"]


def truthy(x):
    """causal flags come as true/false, 1/0 or '1'/'0' depending on the writer."""
    if isinstance(x, str):
        return x.strip().lower() in ("1", "true", "yes")
    return bool(x)


def gpu_name(cli=None):
    """The GPU's name from `ioattn info --json`, else nvidia-smi, else ''."""
    if cli:
        try:
            info = json.loads(subprocess.run([cli, "info", "--json"], capture_output=True, text=True,
                                             timeout=60).stdout)
            if info.get("cuda_device_names"):
                return info["cuda_device_names"][0]
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        return out.splitlines()[0] if out else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def now():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
