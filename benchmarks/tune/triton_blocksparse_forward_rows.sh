#!/usr/bin/env bash
# Session 16, Triton block-sparse forward: the row kernels against the tile and loop kernels, several held lengths
# and rows a program (tuning/triton-blocksparse-forward-rows.txt). Its settings (ROW_FORWARD, FORWARD_ROWS) went in
# session 18, when the forward took the row kernel on every layout: run it from the tree it timed,
# `git show 1eaf011:benchmarks/tune/triton_blocksparse_forward_rows.sh`.
echo "see the comment: this script's settings are gone" >&2
exit 1
