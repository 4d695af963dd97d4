"""Every benchmark in one run, then one summary: python -m bench [--quick]."""

import argparse

from bench import common, fsdp, input_pipeline, pipeline, scaling, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check")
    flags = ["--quick"] if parser.parse_args().quick else []
    ratios = [
        r
        for bench in (pipeline, input_pipeline, train, scaling, fsdp)
        for r in bench.main(flags)["ratios"]
    ]
    print("\nSummary")
    for r in ratios:
        verdict = "reference" if r["met"] is None else ("met" if r["met"] else "NOT met")
        target = "" if r["target"] is None else f" ({common.target_text(r)})"
        print(f"  {r['name']:<52} {r['ratio']:6.2f}x{target}: {verdict}")


if __name__ == "__main__":
    main()
