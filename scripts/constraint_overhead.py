"""What a structured-output constraint costs on the embedded model: for a JSON schema, each
method constrained and unconstrained (tokens/s, mean of a few prompts after one untimed request),
validity of the constrained outputs (``jsonschema``), whether they are constrained greedy's tokens,
the share of tokens that were forced text drafted for free, and what the mask adds to a forward
pass: the seconds spent in the sampler per forward pass, constrained minus unconstrained, against
the constrained decode time per pass (medians over the prompts).

    .venv/bin/python scripts/constraint_overhead.py [--numerics fast] [--schema person|order] [--llamacpp]

``--schema order``: an order record whose long keys and enum values the grammar fixes (about half
the output is forced text), against the default short person record (a few forced tokens).

``--llamacpp`` adds llama-cpp-python's constrained greedy on the same GGUF and prompts
(``response_format`` with the schema, which it turns into a GBNF grammar), end to end against
decodekit's constrained greedy end to end (prefill included), both one request at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import jsonschema

from decodekit.engine import Engine
from decodekit.models import load_model
from decodekit.samplers import Sampler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 30},
                                           "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                       "maxItems": 3}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe Ann, a 31-year-old painter from Lisbon, as JSON.",
           "Give a JSON record for Bob, 45, who lives in Oslo and likes skiing and chess.",
           "Invent a person and describe them as a JSON object with name, age, city and hobbies.",
           "Return JSON for Chen, aged 27, from Taipei, hobbies: running, cooking."]
ORDER = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 40},
    "shipping_address_first_line": {"type": "string", "maxLength": 60},
    "preferred_delivery_window": {"enum": ["weekday_morning_before_noon", "weekday_afternoon_after_noon", "saturday_any_time"]},
    "payment_method_on_file": {"enum": ["credit_card_ending_in_digits", "direct_bank_transfer", "cash_on_delivery"]},
    "order_contains_fragile_items": {"type": "boolean"},
    "number_of_items_in_the_order": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["customer_full_name", "shipping_address_first_line", "preferred_delivery_window",
                 "payment_method_on_file", "order_contains_fragile_items", "number_of_items_in_the_order"],
    "additionalProperties": False}
ORDER_PROMPTS = [
    "Record this order as JSON: Ann Lee, 12 Rua Augusta in Lisbon, mornings please, paying by card, two glass vases.",
    "Make a JSON order record for Bob Stone at 4 Karl Johans gate, Oslo: Saturday delivery, cash, one book.",
    "Turn into a JSON order: Chen Wu, 88 Zhongshan Road, Taipei, afternoons, bank transfer, three mugs (fragile).",
    "JSON order for Dana Cruz, 7 Main Street, Springfield; weekday mornings; card payment; five shirts."]


@dataclass(frozen=True)
class Workload:
    schema: dict
    prompts: list[str]
    max_new_tokens: int


WORKLOADS = {"person": Workload(SCHEMA, PROMPTS, 96), "order": Workload(ORDER, ORDER_PROMPTS, 128)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numerics", default="exact", choices=["exact", "fast"])
    parser.add_argument("--schema", default="person", choices=sorted(WORKLOADS), help="the schema and its prompts")
    parser.add_argument("--llamacpp", action="store_true", help="also llama-cpp-python's constrained greedy (end to end)")
    args = parser.parse_args()
    work = WORKLOADS[args.schema]
    engine = Engine(load_model(numerics=args.numerics))
    with SamplerClock() as clock:
        constrained_table(engine, clock, work)
    if args.llamacpp:
        import torch

        ours = end_to_end(engine, work)
        theirs, valid = llamacpp_end_to_end(torch.get_num_threads(), work)
        print(f"\nconstrained greedy end to end: decodekit {statistics.mean(ours):.1f} tok/s, llama-cpp-python "
              f"{statistics.mean(theirs):.1f} tok/s ({valid}/{len(work.prompts)} valid): "
              f"{statistics.mean(ours) / statistics.mean(theirs):.2f}×")


def constrained_table(engine: Engine, clock: "SamplerClock", work: Workload) -> None:
    """Each method constrained and unconstrained on the prompts: the table's rows."""
    print("| method | constrained tok/s | × constrained greedy | unconstrained tok/s | valid JSON | = constrained greedy "
          "| forced share | mask us a pass | share of a pass |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    reference: dict[str, list[int]] = {}
    greedy_rate = None
    for method in ("greedy", "pld", "suffix", "auto"):
        rates, plain, valid, same, forced, tokens = [], [], 0, 0, 0, 0
        sampler_s = {True: [], False: []}  # per request: seconds in the sampler per forward pass
        pass_s = []  # per constrained request: decode seconds per forward pass
        for constrained, rates_of in ((True, rates), (False, plain)):
            kw = {"constraint": {"json_schema": work.schema}} if constrained else {}
            engine.generate(work.prompts[0], method=method, max_new_tokens=16, **kw)  # untimed
            for prompt in work.prompts:
                clock.calls.clear()
                g = engine.generate(prompt, method=method, max_new_tokens=work.max_new_tokens, **kw)
                rates_of.append(g.stats.tokens_per_s)
                sampler_s[constrained].append(sum(clock.calls) / g.stats.forward_passes)
                if constrained:
                    pass_s.append(g.stats.decode_s / g.stats.forward_passes)
                    reference.setdefault(prompt, g.tokens)
                    same += g.tokens == reference[prompt]
                    forced += g.stats.extra.get("accepted_by_source", {}).get("forced", 0)
                    tokens += len(g.tokens)
                    try:
                        jsonschema.validate(json.loads(g.text), work.schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
        mask_s = statistics.median(sampler_s[True]) - statistics.median(sampler_s[False])
        greedy_rate = greedy_rate or statistics.mean(rates)
        print(f"| {method} | {statistics.mean(rates):.1f} | {statistics.mean(rates) / greedy_rate:.2f}× "
              f"| {statistics.mean(plain):.1f} | {valid}/{len(work.prompts)} | {same}/{len(work.prompts)} | {100 * forced / tokens:.0f}% "
              f"| {mask_s * 1e6:.0f} | {100 * mask_s / statistics.median(pass_s):.1f}% |")


class SamplerClock:
    """Times each call of the sampler (``Sampler.pick_at`` and ``Sampler.process``, the outermost
    call only): where the mask's work happens, whether the grammar's processor masks a row or
    finds a greedy step's best allowed token without writing the row."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self._depth = 0
        self._originals = {name: getattr(Sampler, name) for name in ("pick_at", "process")}
        for name, original in self._originals.items():
            setattr(Sampler, name, self._timed(original))

    def _timed(self, original):
        def timed(sampler, *args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return original(sampler, *args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.calls.append(time.perf_counter() - t0)
        return timed

    def __enter__(self) -> "SamplerClock":
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(Sampler, name, original)


def end_to_end(engine: Engine, work: Workload) -> list[float]:
    """decodekit constrained greedy, tokens per second of each request end to end (prefill included)."""
    engine.generate(work.prompts[0], max_new_tokens=16, constraint={"json_schema": work.schema})  # untimed
    rates = []
    for prompt in work.prompts:
        g = engine.generate(prompt, max_new_tokens=work.max_new_tokens, constraint={"json_schema": work.schema})
        rates.append(len(g.tokens) / (g.stats.prefill_s + g.stats.decode_s))
    return rates


def llamacpp_end_to_end(threads: int, work: Workload) -> tuple[list[float], int]:
    """llama-cpp-python's constrained greedy on the same GGUF: tokens per second of each request
    end to end, and how many outputs are valid."""
    from llama_cpp import Llama

    from decodekit.bench.baselines import gguf_for

    llm = Llama(model_path=str(gguf_for(None)), n_ctx=2048, n_threads=threads, verbose=False)
    fmt = {"type": "json_object", "schema": work.schema}

    def ask(prompt: str, tokens: int) -> dict:
        return llm.create_chat_completion([{"role": "user", "content": prompt}], response_format=fmt,
                                          temperature=0.0, max_tokens=tokens)

    ask(work.prompts[0], 16)  # untimed
    rates, valid = [], 0
    for prompt in work.prompts:
        t0 = time.perf_counter()
        out = ask(prompt, work.max_new_tokens)
        rates.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t0))
        try:
            jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), work.schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return rates, valid


if __name__ == "__main__":
    main()
