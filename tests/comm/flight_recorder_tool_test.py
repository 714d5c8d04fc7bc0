#!/usr/bin/env python3
"""tools/flight_recorder.py on synthetic dumps: the first differing sequence number, rings that lost
their oldest entries, sizes that may differ (all_gather_bytes), ranks that never arrived or arrived
last, missing dumps, and point-to-point operations matched with their peers' through subgroups'
world ranks."""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

# tools/flight_recorder.py beside this file's source (Bazel's runfiles link to it).
TOOLS = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", "tools")
sys.path.insert(0, TOOLS)
import flight_recorder  # noqa: E402

S = 1_000_000_000


def collective(seq, kind="all_gather_into_tensor", label="blocks.0", state="completed", comm="world",
               ranks=(0, 1, 2), rank=0, elements=(4, 12), issued=0):
    return {"id": seq, "comm": comm, "comm_size": len(ranks), "comm_rank": ranks.index(rank),
            "world_rank": rank, "world_ranks": list(ranks), "op": "collective", "seq": seq,
            "backend_seq": seq, "kind": kind, "label": label, "api": "", "dtype": "Float",
            "input_elements": elements[0], "output_elements": elements[1], "bytes": 16, "state": state,
            "error": "", "issued_ns": issued or 100 * S + seq, "started_ns": 0, "finished_ns": 0}


def p2p(seq, kind, peer, tag, channel_seq, state="completed", comm="world", ranks=(0, 1, 2), rank=0):
    return {"id": 1000 + seq, "comm": comm, "comm_size": len(ranks), "comm_rank": ranks.index(rank),
            "world_rank": rank, "world_ranks": list(ranks), "op": "p2p", "seq": seq, "backend_seq": seq,
            "kind": kind, "peer": peer, "tag": tag, "channel_seq": channel_seq, "label": "activations",
            "api": "", "dtype": "Float", "input_elements": 8, "output_elements": -1, "bytes": 32,
            "state": state, "error": "", "issued_ns": 100 * S, "started_ns": 0, "finished_ns": 0}


class ToolTest(unittest.TestCase):
    def run_tool(self, dumps, *args):
        with tempfile.TemporaryDirectory() as folder:
            for rank, entries in dumps.items():
                data = {"version": 1, "rank": rank, "rank_name": f"rank{rank}", "pid": 1, "host": "h",
                        "reason": "test", "earlier_reasons": [], "dump_time_ns": 200 * S, "capacity": 16,
                        "recorded": len(entries), "entries": entries}
                with open(os.path.join(folder, f"flight_recorder.rank{rank}.json"), "w") as f:
                    json.dump(data, f)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = flight_recorder.main([folder, *args])
            self.assertEqual(rc, 0)
            return out.getvalue()

    def test_first_differing_sequence_number(self):
        same = [collective(s, rank=0) for s in range(1, 5)]
        dumps = {r: [dict(e, comm_rank=r, world_rank=r) for e in same] for r in range(3)}
        dumps[2].append(collective(5, kind="all_reduce", label="loss", rank=2, elements=(1, 1)))
        for r in (0, 1):
            dumps[r].append(collective(5, rank=r))
        out = self.run_tool(dumps)
        self.assertIn("the ranks first differ at sequence number 5 (kind, tag, element counts differ):", out)
        self.assertIn("    ranks 0, 1: all_gather_into_tensor #5 (Float; elements 4 in, 12 out; tag 'blocks.0')", out)
        self.assertIn("    rank 2: all_reduce #5 (Float; elements 1 in, 1 out; tag 'loss')", out)

    def test_rings_that_lost_old_entries_and_variable_sizes_are_no_difference(self):
        dumps = {0: [collective(s, rank=0) for s in range(3, 9)],
                 1: [collective(s, rank=1) for s in range(1, 9)],
                 2: [collective(s, rank=2) for s in range(1, 9)]}
        for r in range(3):
            dumps[r].append(collective(9, kind="all_gather_bytes", label="meta", rank=r, elements=(10 + r, -1)))
        out = self.run_tool(dumps)
        self.assertIn("- nowhere: every rank recorded the same collectives", out)

    def test_a_rank_that_never_arrived_and_a_missing_dump(self):
        dumps = {0: [collective(s, rank=0, ranks=(0, 1, 2, 3)) for s in range(1, 6)],
                 1: [collective(s, rank=1, ranks=(0, 1, 2, 3)) for s in range(1, 6)],
                 2: [collective(s, rank=2, ranks=(0, 1, 2, 3)) for s in range(1, 4)]}
        dumps[0][-1]["state"] = dumps[1][-1]["state"] = "issued"
        out = self.run_tool(dumps)
        self.assertIn("- no dump from rank 3 (killed, stopped, or ended without dumping)", out)
        self.assertIn("the ranks first differ at sequence number 4: rank 2 never arrived (rank 2 at #3); "
                      "ranks 0, 1 issued all_gather_into_tensor #4", out)
        self.assertIn("rank 3: no dump", out)

    def test_a_rank_that_arrived_last(self):
        dumps = {r: [collective(s, rank=r) for s in range(1, 4)] for r in range(3)}
        for r in range(3):
            dumps[r].append(collective(4, rank=r, state="started", issued=(150 if r == 1 else 100) * S))
        out = self.run_tool(dumps)
        self.assertIn("every rank issued sequence number 4, but rank 1 arrived last, 50.0 s after ranks 0, 2", out)

    def test_point_to_point_matched_through_a_subgroup(self):
        # A pipeline group over world ranks 1 and 3: group rank 0 is world rank 1.
        ranks = (1, 3)
        dumps = {
            0: [collective(1, rank=0)],
            1: [collective(1, rank=1), p2p(1, "send", peer=1, tag=0, channel_seq=1, ranks=ranks, rank=1)],
            2: [collective(1, rank=2)],
            3: [p2p(1, "recv", peer=0, tag=0, channel_seq=1, ranks=ranks, rank=3),
                p2p(2, "recv", peer=0, tag=0, channel_seq=2, state="issued", ranks=ranks, rank=3)],
        }
        out = self.run_tool(dumps, "--world-size", "4")
        self.assertIn("rank 3's recv #2 from group rank 0 (tag 0, #2 on that channel)", out)
        self.assertIn("rank 1 never posted the matching send (it posted 1 send on this channel); "
                      "its last operation: send #1", out)

    def test_a_pending_send_whose_peer_left_no_dump(self):
        dumps = {0: [p2p(1, "send", peer=1, tag=3, channel_seq=1, state="started", ranks=(0, 1), rank=0)]}
        out = self.run_tool(dumps)
        self.assertIn("rank 0's send #1 to group rank 1 (tag 3, #1 on that channel)", out)
        self.assertIn("its peer, rank 1, left no dump: no matching recv is known", out)


if __name__ == "__main__":
    unittest.main()
