"""A five-turn chat on a model, as ``decodekit chat`` sends it (the conversation so far, greedy, 64
tokens a turn): each turn's time, and the tokens of every answer (to compare two versions of the code).

    .venv/bin/python scripts/chat_turns.py --numerics exact
    PYTHONPATH=<another checkout>/src .venv/bin/python scripts/chat_turns.py --numerics exact   # the code there
"""

from __future__ import annotations

import argparse
import json
import time

import decodekit
from decodekit.arguments import add_model_argument, add_numerics_arguments
from decodekit.engine import Engine

TURNS = ("Tell me about the history of Rome.", "What happened after that?", "Who were the most famous emperors?",
         "Tell me more about the second one.", "Summarise our conversation in three sentences.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_numerics_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    engine = Engine(args.model, dtype=args.dtype, numerics=args.numerics)
    engine.generate("warm up", max_new_tokens=4)
    messages, seconds, answers = [], [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        start = time.perf_counter()
        answer = engine.generate(messages, max_new_tokens=args.max_new_tokens)
        seconds.append(round(time.perf_counter() - start, 3))
        answers.append(answer.tokens)
        messages.append({"role": "assistant", "content": answer.text})
    print(json.dumps({"code": decodekit.__file__, "turn_s": seconds, "total_s": round(sum(seconds), 3), "answers": answers}))


if __name__ == "__main__":
    main()
