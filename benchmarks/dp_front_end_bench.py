"""What ``LLM(..., data_parallel_size=N)`` costs its own process per request: the offline
front end (``engine_process/sync_client.py`` over ``dp_client.py``, outputs rebuilt by
``OutputAssembler``) driven as ``LLM.generate`` drives it, over stand-in replicas that answer at
once, so that nothing but this process's work is timed.

The requests are the bench's throughput workload (prompts and max_tokens uniform in 100..1024,
detokenize off), routed over two replicas; each replica's answers are what its engine process
would send: one "step" message per step (``--steps`` a replica), each request's whole output in
the message of the step that finishes it. Printed: CPU seconds of this process (both threads)
and wall seconds, for submitting (validation, routing, pickling) and for receiving (unpickling,
routing back, assembling the RequestOutputs), per request and per step message.

    python benchmarks/dp_front_end_bench.py [--requests 256] [--steps 1024]
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

from compiled_llm.cli.bench.workloads import throughput_requests
from compiled_llm.serve.core.request_validator import RequestValidator
from compiled_llm.serve.core.sequence import RequestMetrics
from compiled_llm.serve.engine_process.dp_client import DataParallelClient
from compiled_llm.serve.engine_process.engine_messages import EngineInfo, EngineSnapshot
from compiled_llm.serve.engine_process.sync_client import SyncClient
from compiled_llm.serve.sampling_params import SamplingParams

VOCAB = 151_936  # Qwen2.5's
INFO = EngineInfo(name="stand-in", vocab_size=VOCAB, max_model_len=4096, block_size=16, num_blocks=1 << 20,
                  max_num_seqs=256, generation_defaults={}, device="cuda:0", max_step_tokens=4096)
SNAPSHOT = EngineSnapshot(128, 0, 0.3, 10**6, 10**6, 0, 10**6, 0, steps=1000)


class StandInReplica:
    """An engine core client whose engine answers at once: ``send`` pickles what it is sent (what
    the pipe costs this side), ``answer`` hands it the messages an engine would send back."""

    def __init__(self):
        self.info, self.tokenizer, self.start_snapshot = INFO, None, SNAPSHOT
        self.validator = RequestValidator(None, VOCAB, INFO.max_model_len, INFO.block_size, INFO.num_blocks,
                                          INFO.max_num_seqs, max_step_tokens=INFO.max_step_tokens)
        self.added: list[tuple] = []
        self.alive = True

    def start(self, on_message) -> None:
        self.on_message = on_message

    def send(self, message: tuple) -> None:
        pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if message[0] == "add":
            self.added += message[1]

    def tell_to_stop(self) -> None:
        self.alive = False

    def wait_stopped(self, deadline: float) -> None:
        pass

    def kill(self) -> None:
        self.alive = False


def engine_messages(added: list[tuple], steps: int, seed: int) -> list[bytes]:
    """One replica's "step" messages, pickled: each request finished in the step of its last token."""
    rng = random.Random(seed)
    finishing: dict[int, list] = {}
    for rid, _, _, params in added:
        finishing.setdefault(min(params.max_tokens, steps) - 1, []).append((rid, params.max_tokens))
    blobs = []
    for step in range(steps):
        outputs = []
        for rid, n in finishing.get(step, ()):
            metrics = RequestMetrics(1.0)
            metrics.first_token_time, metrics.finished_time = 1.1, 2.0
            tokens = [rng.randrange(VOCAB) for _ in range(n)]
            outputs.append((rid, True, metrics, None, [(0, "", tokens, "length", None, None, None)]))
        blobs.append(pickle.dumps(("step", outputs, [], [], SNAPSHOT), protocol=pickle.HIGHEST_PROTOCOL))
    return blobs


def measure(num_requests: int, steps: int) -> None:
    prompts, max_tokens = throughput_requests(num_requests)
    replicas = [StandInReplica(), StandInReplica()]
    client = SyncClient(DataParallelClient(replicas))
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, detokenize=False) for n in max_tokens]
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        requests = [client.validator.validate({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
        cpu1 = time.process_time()
        submission = client.submit(requests)
        while sum(len(r.added) for r in replicas) < num_requests:
            time.sleep(0)
        cpu2, wall2 = time.process_time(), time.perf_counter()
        answers = [(i, blob) for i, r in enumerate(replicas) for blob in engine_messages(r.added, steps, i)]
        random.Random(0).shuffle(answers)  # the replicas' messages interleave

        def deliver() -> None:  # on the loop thread, as the pipes' reader would
            for i, blob in answers:
                replicas[i].on_message(pickle.loads(blob))

        cpu3, wall3 = time.process_time(), time.perf_counter()
        client._loop.call_soon_threadsafe(deliver)
        taken = 0
        while taken < num_requests:
            taken += len(submission.take())
        cpu4, wall4 = time.process_time(), time.perf_counter()
    finally:
        client.shutdown()
    n, messages = num_requests, len(answers)
    print(f"{n} requests, {sum(max_tokens):,} output tokens, {messages} step messages from 2 replicas")
    print(f"  validate (as with one engine)  {1e6 * (cpu1 - cpu0) / n:8.1f} us CPU a request")
    print(f"  submit: route, pickle          {1e6 * (cpu2 - cpu1) / n:8.1f} us CPU a request; "
          f"{1e3 * (wall2 - wall0):.1f} ms wall before the replicas had every request")
    print(f"  receive: unpickle, assemble    {1e3 * (cpu4 - cpu3):8.1f} ms CPU, {1e3 * (wall4 - wall3):.1f} ms wall, "
          f"for {n} outputs and {messages} messages")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1024, help="step messages per replica")
    args = parser.parse_args()
    measure(args.requests, args.steps)
    # the step messages alone (no output in them): what a replica's every step costs this side
    replicas = [StandInReplica(), StandInReplica()]
    client = SyncClient(DataParallelClient(replicas))
    try:
        blob = pickle.dumps(("step", [], [], [], SNAPSHOT), protocol=pickle.HIGHEST_PROTOCOL)
        count = 20_000
        cpu0 = time.process_time()
        for _ in range(count):
            replicas[0].on_message(pickle.loads(blob))
        print(f"an empty step message                {1e6 * (time.process_time() - cpu0) / count:8.1f} us CPU")
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
