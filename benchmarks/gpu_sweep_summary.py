"""The GPU sweep's figures from its outcome log (``tests.support.outcomes``), as BENCHMARKS.md gives them.

    python3 -m pytest -n 14 -p tests.support.outcomes --outcomes gpu.jsonl tests/gpu      # on the GPU machine
    python benchmarks/gpu_sweep_summary.py gpu.jsonl [more.jsonl ...] [--types types.json]

Per part of ``tests/gpu/test_architectures_bf16.py`` (flash, cuDNN frontend, compiled): tests passed
and failed, the layouts served, types refused, where the cuDNN frontend ran, rows served from a
longer row and over cached prefixes, and the file's error ÷ plain transformers' bf16 error from
float32 at each type's worst layer (median and largest over the types served). Other test files:
passed and failed. Several logs are read in order; a test's later line replaces its earlier one.
``--types`` writes the per-type figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

#: The sweep's test functions, by the part of it each is.
PARTS = {"test_bf16_files_are_as_close_to_float32_as_plain_transformers_bf16": "flash",
         "test_bf16_files_through_the_cudnn_frontend_are_as_close_as_plain_transformers_bf16": "cudnn",
         "test_compiled_bf16_files_are_as_close_to_float32_as_plain_transformers_bf16": "compiled"}


def read_outcomes(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """Every test's latest line, by (test id, phase)."""
    lines: dict[tuple[str, str], dict] = {}
    for path in paths:
        for text in path.read_text().splitlines():
            line = json.loads(text)
            lines[line["id"], line["when"]] = line
    return lines


def property_value(value: object) -> object:
    """A recorded property as the test recorded it (JSON strings, such as ``errors``, decoded)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def type_figures(line: dict) -> dict:
    """One sweep test's figures: layout, whether compiled, cuDNN calls, shared and cached tokens, and the
    worst layer's ratio of the file's error to plain bf16's (over every prompt and layer)."""
    properties = {name: property_value(value) for name, value in line["properties"].items()}
    figures = {"outcome": line["outcome"], "seconds": line["seconds"], "batching": properties.get("batching"),
               "compiled": properties.get("compiled"), "cudnn_calls": properties.get("cudnn_calls"),
               "shared_tokens": properties.get("shared_tokens"), "cached_tokens": properties.get("cached_tokens")}
    errors = properties.get("errors") or []
    pairs = [pair for _, ours, theirs in errors for pair in zip(ours, theirs)]  # (file's, plain bf16's) per layer
    if pairs:
        figures["worst_error"] = max(ours for ours, _ in pairs)
        figures["plain_bf16_worst_error"] = max(theirs for _, theirs in pairs)
        figures["worst_ratio"] = max(ours / theirs if theirs else float(ours > 0) for ours, theirs in pairs)
    return figures


def summarize(lines: dict[tuple[str, str], dict]) -> tuple[dict[str, dict[str, dict]], dict[str, Counter]]:
    """Per sweep part, each type's figures; per other test file, its outcomes counted."""
    parts: dict[str, dict[str, dict]] = defaultdict(dict)
    others: dict[str, Counter] = defaultdict(Counter)
    for (test_id, when), line in lines.items():
        path, _, name = test_id.partition("::")
        function, _, param = name.partition("[")
        if function in PARTS and when == "call":
            parts[PARTS[function]][param.rstrip("]")] = type_figures(line)
        elif function in PARTS:  # a setup or teardown that failed
            parts[PARTS[function]][param.rstrip("]")] = {"outcome": f"{line['outcome']} ({when})"}
        else:
            others[Path(path).name][line["outcome"] if when == "call" else f"{line['outcome']} ({when})"] += 1
    return parts, others


def describe_part(name: str, types: dict[str, dict]) -> list[str]:
    """The part's lines as printed."""
    outcomes = Counter(figures["outcome"] for figures in types.values())
    layouts = Counter(figures.get("batching") for figures in types.values() if figures["outcome"] == "passed")
    served = {key: figures for key, figures in types.items() if figures.get("batching") not in (None, "refused")}
    lines = [f"{name}: {len(types)} tests, " + ", ".join(f"{count} {outcome}" for outcome, count in outcomes.items()),
             f"  served {len(served)} (packed {layouts['packed']} / padded {layouts['padded']} / one per batch "
             f"{layouts['single']}), refused {layouts['refused']}, compiled "
             f"{sum(figures.get('compiled') is True for figures in served.values())}",
             f"  cuDNN frontend ran in {sum(bool(figures.get('cudnn_calls')) for figures in served.values())}; rows "
             f"shared on {sum(figures.get('shared_tokens') not in (None, 0) for figures in served.values())}, "
             f"cached prefixes on {sum(figures.get('cached_tokens') not in (None, 0) for figures in served.values())}"]
    ratios = {key: figures["worst_ratio"] for key, figures in served.items() if "worst_ratio" in figures}
    if ratios:
        largest = max(ratios, key=ratios.get)
        equal = sum(ratio <= 1.0 for ratio in ratios.values())
        median = statistics.median(ratios.values())
        lines.append(f"  the file's error / plain bf16's at the worst layer: median {median:.3f}, largest "
                     f"{ratios[largest]:.3f} ({largest}); at most plain's in {equal} of {len(ratios)}")
    failed = sorted(key for key, figures in types.items() if not figures["outcome"].startswith("passed"))
    if failed:
        lines.append(f"  not passed: {', '.join(failed)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path, help="outcome logs (--outcomes), read in order")
    parser.add_argument("--types", type=Path, help="write each part's per-type figures here as JSON")
    args = parser.parse_args()
    parts, others = summarize(read_outcomes(args.logs))
    for name in ("flash", "cudnn", "compiled"):
        if name in parts:
            print("\n".join(describe_part(name, parts[name])))
    for path, outcomes in sorted(others.items()):
        print(f"{path}: " + ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items())))
    if args.types:
        args.types.write_text(json.dumps(parts, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
