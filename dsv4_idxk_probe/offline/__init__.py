"""Offline analysis of room logs: the join of prefill and decode records, the
verdicts and localisation per room, the diff's JSON and exit status, and the
HTML report. Reads plain records only: no torch, no SGLang (import-contract
test). The log line format, writer and reader stay in `roomlog/`.
"""
