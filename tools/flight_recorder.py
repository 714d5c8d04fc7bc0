#!/usr/bin/env python3
"""Reads every rank's flight recorder dump and says where the ranks part ways.

    python3 tools/flight_recorder.py DIR [--world-size N] [--entries K]

DIR holds the dumps a job wrote (flight_recorder.rank<R>.json, comm/flight_recorder.h; by default
./fsdp_flight_recorder, or FSDP_FLIGHT_RECORDER_DIR). The report:

  * which ranks left no dump (killed, stopped, or ended without dumping): they never arrived;
  * per communicator, the ranks' collectives lined up by sequence number: the first sequence
    number at which they differ (kind, tag, dtype or element counts), or at which some ranks issued
    a collective that others never issued (their last sequence number is lower); when all issued
    the same ones, the first collective not completed everywhere if one rank issued it at least
    1 s after all the others (it arrived last);
  * point-to-point operations that never completed, each matched with its peer's (the k-th send
    from A to B with tag T pairs with B's k-th recv from A with tag T): the peer that never posted
    it, or left no dump;
  * what each rank was doing: its dump's reason, its last operation and the oldest one unfinished.

Exit status 0 when the dumps were read (whatever they say), 2 when DIR holds none.
"""

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

# A rank that issued a collective this much later than every other rank "arrived last".
LATE_ARRIVAL_S = 1.0

# Kinds whose element counts legitimately differ across ranks (per-rank sizes).
VARIABLE_SIZE_KINDS = {"all_gather_bytes", "all_to_all"}


def load_dumps(folder):
    dumps = {}
    problems = []
    for path in sorted(glob.glob(os.path.join(folder, "flight_recorder.*.json"))):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"{os.path.basename(path)}: unreadable ({e})")
            continue
        rank = data.get("rank")
        if rank is None:
            m = re.search(r"flight_recorder\.rank(\d+)\.json$", path)
            rank = int(m.group(1)) if m else data.get("rank_name", path)
        data["_path"] = path
        dumps[rank] = data
    return dumps, problems


def comm_key(entry):
    ranks = entry.get("world_ranks")
    if isinstance(ranks, list):
        ranks = tuple(ranks)
    return (entry.get("comm", "?"), ranks, entry.get("comm_size"))


def comm_title(key):
    name, ranks, size = key
    if isinstance(ranks, tuple):
        return f"communicator '{name}' ({size} ranks, world ranks {list(ranks)})"
    if isinstance(ranks, str):
        return f"communicator '{name}' ({size} ranks, world ranks {ranks})"
    return f"communicator '{name}' ({size} ranks, world ranks unknown)"


def rank_list(ranks):
    ranks = sorted(ranks, key=lambda r: (not isinstance(r, int), r if isinstance(r, int) else str(r)))
    return ", ".join(str(r) for r in ranks)


def plural(ranks, one="rank", many="ranks"):
    return f"{one if len(ranks) == 1 else many} {rank_list(ranks)}"


def describe(entry):
    kind = entry.get("kind", "?")
    parts = []
    if entry.get("op") == "p2p":
        direction = "to" if kind == "send" else "from"
        head = f"{kind} #{entry.get('seq')} {direction} group rank {entry.get('peer')} (tag {entry.get('tag')}, " \
               f"#{entry.get('channel_seq')} on that channel)"
    else:
        head = f"{kind} #{entry.get('seq')}"
    if entry.get("backend_seq") not in (None, entry.get("seq")):
        head += f" (the backend's #{entry['backend_seq']})"
    if entry.get("dtype"):
        parts.append(entry["dtype"])
    sizes = []
    if entry.get("input_elements", -1) >= 0:
        sizes.append(f"{entry['input_elements']} in")
    if entry.get("output_elements", -1) >= 0:
        sizes.append(f"{entry['output_elements']} out")
    if sizes:
        parts.append("elements " + ", ".join(sizes))
    if entry.get("label"):
        parts.append(f"tag '{entry['label']}'")
    if entry.get("api"):
        parts.append(f"issued by {entry['api']}")
    text = f"{head} ({'; '.join(parts)})" if parts else head
    state = entry.get("state", "?")
    if state == "failed" and entry.get("error"):
        error = entry["error"]
        if len(error) > 300:
            error = error[:300] + "..."
        state = f"failed: {error}"
    return f"{text} [{state}]"


def signature(entry):
    kind = entry.get("kind")
    sizes = None if kind in VARIABLE_SIZE_KINDS else (entry.get("input_elements"), entry.get("output_elements"))
    return (kind, entry.get("label", ""), entry.get("dtype", ""), sizes)


def differences(a, b):
    names = ["kind", "tag", "dtype", "element counts"]
    return [n for n, x, y in zip(names, signature(a), signature(b)) if x != y]


def world_rank_of(key, group_rank):
    ranks = key[1]
    if isinstance(ranks, tuple) and 0 <= group_rank < len(ranks):
        return ranks[group_rank]
    return group_rank  # unknown: a communicator over the whole world is the usual case


def analyse(dumps, world_size):
    """Returns (verdict lines, per-rank lines)."""
    verdict = []
    dumped = set(dumps)
    int_ranks = {r for r in dumped if isinstance(r, int)}

    # Collectives and point-to-point entries per communicator and rank.
    collectives = defaultdict(lambda: defaultdict(dict))  # key -> rank -> seq -> entry
    p2p = defaultdict(lambda: defaultdict(list))  # key -> rank -> [entries]
    sizes = set()
    for rank, data in dumps.items():
        for e in data.get("entries", []):
            key = comm_key(e)
            if isinstance(key[1], tuple):
                sizes.add(max(key[1]) + 1)
            if isinstance(key[2], int):
                sizes.add(key[2])  # no group is larger than the world
            if e.get("op") == "p2p":
                p2p[key][rank].append(e)
            else:
                collectives[key][rank][e.get("seq")] = e  # a later entry of one seq wins
    if world_size is None:
        world_size = max(sizes | ({max(int_ranks) + 1} if int_ranks else set()) | {0})
    missing = sorted(set(range(world_size)) - int_ranks)
    if missing:
        verdict.append(f"no dump from {plural(missing)} (killed, stopped, or ended without dumping): "
                       f"{'it' if len(missing) == 1 else 'they'} never arrived at the others' point")

    for key in sorted(collectives, key=lambda k: (k[0], str(k[1]))):
        per_rank = collectives[key]
        if isinstance(key[1], tuple):
            members = list(key[1])
        elif key[2] == world_size:  # world ranks unknown, but as many ranks as the world
            members = list(range(world_size))
        else:
            members = sorted(per_rank, key=str)
        absent = [m for m in members if m not in dumps]
        present = [m for m in members if m in per_rank]
        silent = [m for m in members if m in dumps and m not in per_rank]  # dumped, nothing on this comm
        if not present:
            continue
        title = comm_title(key)
        first = max(min(per_rank[r]) for r in present)  # older ones may have left some rings
        last = max(max(per_rank[r]) for r in present)
        found = False
        for seq in range(first, last + 1):
            have = [r for r in present if seq in per_rank[r]]
            lacking = [r for r in present if seq not in per_rank[r]]
            if not have:
                continue
            groups = defaultdict(list)
            for r in have:
                groups[signature(per_rank[r][seq])].append(r)
            if len(groups) > 1:
                found = True
                ordered = sorted(groups.values(), key=len, reverse=True)
                reference = per_rank[ordered[0][0]][seq]
                verdict.append(f"{title}: the ranks first differ at sequence number {seq} "
                               f"({', '.join(differences(reference, per_rank[ordered[1][0]][seq]))} differ):")
                for ranks in ordered:
                    verdict.append(f"    {plural(ranks)}: {describe(per_rank[ranks[0]][seq])}")
                for r in lacking:
                    verdict.append(f"    rank {r}: never issued it (its last collective here is "
                                   f"#{max(per_rank[r])})")
                break
            if lacking:
                found = True
                behind = ", ".join(f"rank {r} at #{max(per_rank[r])}" for r in sorted(lacking))
                verdict.append(f"{title}: the ranks first differ at sequence number {seq}: "
                               f"{plural(lacking)} never arrived ({behind}); "
                               f"{plural(have)} issued {describe(per_rank[have[0]][seq])}")
                break
        if not found:
            # Every rank issued the same collectives: the first one not completed everywhere, and
            # whether one rank issued it much later than the others (it arrived last: the others
            # waited for it, e.g. a rank that was stopped and resumed before it dumped).
            for seq in range(first, last + 1):
                have = [r for r in present if seq in per_rank[r]]
                if len(have) < 2 or all(per_rank[r][seq].get("state") == "completed" for r in have):
                    continue
                times = {r: per_rank[r][seq].get("issued_ns", 0) for r in have}
                latest = max(have, key=lambda r: times[r])
                others = [r for r in have if r != latest]
                gap = (times[latest] - max(times[r] for r in others)) / 1e9
                if gap >= LATE_ARRIVAL_S:
                    found = True
                    verdict.append(f"{title}: every rank issued sequence number {seq}, but rank {latest} arrived "
                                   f"last, {gap:.1f} s after {plural(others)} (which waited for it): "
                                   f"{describe(per_rank[latest][seq])}")
                break
        if not found and (absent or silent) and len(members) > 1:
            nobody = absent + silent
            verdict.append(f"{title}: {plural(present)} issued up to sequence number {last} "
                           f"({describe(per_rank[present[0]][last])}); {plural(nobody)} "
                           f"{'left no dump' if not silent else 'recorded nothing on it'}")

    # Point-to-point operations that never completed, with their peers'.
    for key, per_rank in p2p.items():
        channels = defaultdict(dict)  # (sender, receiver, tag) -> direction -> {channel_seq: (rank, entry)}
        for rank, entries in per_rank.items():
            for e in entries:
                me = rank
                peer = world_rank_of(key, e.get("peer", -1))
                chan = (me, peer, e.get("tag")) if e.get("kind") == "send" else (peer, me, e.get("tag"))
                channels[chan].setdefault(e.get("kind"), {})[e.get("channel_seq")] = (rank, e)
        for rank, entries in sorted(per_rank.items(), key=lambda kv: str(kv[0])):
            for e in entries:
                if e.get("state") in ("completed",):
                    continue
                peer = world_rank_of(key, e.get("peer", -1))
                kind = e.get("kind")
                other = "recv" if kind == "send" else "send"
                chan = (rank, peer, e.get("tag")) if kind == "send" else (peer, rank, e.get("tag"))
                n = e.get("channel_seq")
                line = f"{comm_title(key)}: rank {rank}'s {describe(e)}: "
                if peer not in dumps:
                    line += f"its peer, rank {peer}, left no dump: no matching {other} is known"
                else:
                    theirs = channels[chan].get(other, {})
                    if n in theirs:
                        line += f"rank {peer} posted the matching {describe(theirs[n][1])}"
                    else:
                        posted = max(theirs) if theirs else 0
                        line += (f"rank {peer} never posted the matching {other} (it posted {posted} "
                                 f"{other}{'s' if posted != 1 else ''} on this channel)")
                        peer_entries = dumps[peer].get("entries", [])
                        if peer_entries:
                            line += f"; its last operation: {describe(peer_entries[-1])}"
                verdict.append(line)

    # What each rank was doing.
    lines = []
    for rank in sorted(set(range(world_size)) | dumped, key=lambda r: (not isinstance(r, int), str(r).zfill(8))):
        if rank not in dumps:
            lines.append(f"rank {rank}: no dump")
            continue
        data = dumps[rank]
        entries = data.get("entries", [])
        reason = data.get("reason", "?")
        if len(reason) > 400:
            reason = reason[:400] + "..."
        earlier = data.get("earlier_reasons") or []
        head = f"rank {rank} (pid {data.get('pid')} on {data.get('host')}), dumped on: {reason}"
        if earlier:
            head += f" (earlier dumps: {'; '.join(earlier)})"
        lines.append(head)
        if not entries:
            lines.append("    no operations recorded")
            continue
        now = data.get("dump_time_ns", 0)
        last = entries[-1]
        age = (now - last.get("issued_ns", now)) / 1e9
        lines.append(f"    last: {comm_title(comm_key(last))}: {describe(last)}, issued {age:.1f} s before the dump")
        unfinished = [e for e in entries if e.get("state") in ("issued", "started")]
        if unfinished and unfinished[0] is not last:
            u = unfinished[0]
            age = (now - u.get("issued_ns", now)) / 1e9
            lines.append(f"    oldest unfinished: {comm_title(comm_key(u))}: {describe(u)}, issued {age:.1f} s "
                         f"before the dump")
        lines.append(f"    {len(entries)} entries kept of {data.get('recorded')} recorded")
    return verdict, lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default="fsdp_flight_recorder",
                        help="the folder of the dumps (default: ./fsdp_flight_recorder)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks expected (default: from the communicators' world ranks and the dumps)")
    parser.add_argument("--entries", type=int, default=0,
                        help="also print each rank's last K entries")
    args = parser.parse_args(argv)
    dumps, problems = load_dumps(args.folder)
    if not dumps:
        print(f"flight recorder: no dumps (flight_recorder.*.json) in {args.folder}")
        for p in problems:
            print(f"  {p}")
        return 2
    verdict, lines = analyse(dumps, args.world_size)
    print(f"flight recorder: {len(dumps)} dump{'s' if len(dumps) != 1 else ''} in {args.folder} "
          f"(ranks {rank_list(dumps)})")
    for p in problems:
        print(f"  {p}")
    print("== Where the ranks part ways")
    if verdict:
        for v in verdict:
            print(v if v.startswith("    ") else f"- {v}")
    else:
        print("- nowhere: every rank recorded the same collectives, and no transfer is pending")
    print("== What each rank was doing")
    for line in lines:
        print(line)
    if args.entries > 0:
        print(f"== The last {args.entries} entries of each rank")
        for rank, data in sorted(dumps.items(), key=lambda kv: str(kv[0]).zfill(8)):
            print(f"rank {rank}:")
            for e in data.get("entries", [])[-args.entries:]:
                print(f"    {comm_title(comm_key(e))}: {describe(e)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
