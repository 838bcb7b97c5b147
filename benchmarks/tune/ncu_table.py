"""Summarises `ncu --csv --page raw` output (stdin): per kernel, its time, DRAM and L2 bytes against the
tensor bytes it should move, and its most frequent warp stall reasons (cycles per issued instruction).

    ncu --csv --page raw --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,... \\
        python3 benchmarks/tune/profile_forward.py ... | python3 benchmarks/tune/ncu_table.py
"""
import csv
import sys

STALL = "smsp__average_warps_issue_stalled_"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def main():
    lines = [line for line in sys.stdin if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    for row in rows[1:] if rows and not rows[0].get("ID", "").isdigit() else rows:  # the units row
        name = row["Kernel Name"].split("(")[0].split("[")[0][:60]
        ms = number(row.get("gpu__time_duration.sum", "nan")) / 1e6
        read, write = number(row["dram__bytes_read.sum"]), number(row["dram__bytes_write.sum"])
        l2 = number(row["lts__t_bytes.sum"])
        stalls = sorted(((number(v), k[len(STALL):].replace("_per_issue_active.ratio", ""))
                         for k, v in row.items() if k.startswith(STALL)), reverse=True)
        top = ", ".join(f"{k} {v:.1f}" for v, k in stalls[:6])
        print(f"{name:<60} {ms * 1e3:8.1f} us  DRAM read {read / 2**20:7.1f} MiB write {write / 2**20:7.1f} MiB"
              f"  L2 {l2 / 2**20:8.1f} MiB  ({(read + write) / (ms * 1e6):6.0f} GB/s)\n    stalls: {top}")


if __name__ == "__main__":
    main()
