"""The progress bar of a run: tqdm when importable, else one line on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """tqdm when importable, else a one-line bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True)

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.start
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        sys.stderr.write(line[:120].ljust(120))
        sys.stderr.flush()

    def note(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            sys.stderr.write("\r" + " " * 120 + "\r" + message + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
