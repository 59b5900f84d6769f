"""math_verify's comparison in a process of its own, for stages/rewards/math_reward.py: "ready" once,
then for each JSON [gold, predicted] line in, "1" or "0" a line out. Each comparison may use
`argv[1]` seconds of CPU time: then SIGPROF, left at its default action, ends this process even
inside C code, and the parent scores the answer incorrect. math_verify's own timeouts (SIGALRM,
wall-clock) are turned off here."""

import json
import logging
import signal
import sys


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; stdin closing ends us
    replies, sys.stdout = sys.stdout, sys.stderr  # stray prints (even at import) must not pose as replies
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that its timeouts are off

    def matches(gold: str, predicted: str) -> bool:
        try:
            gold_parsed = parse(f"${gold}$", parsing_timeout=None)
            predicted_parsed = parse(f"${predicted}$", parsing_timeout=None)
            return bool(gold_parsed and predicted_parsed) and verify(
                gold_parsed, predicted_parsed, timeout_seconds=None
            )
        except Exception:  # a malformed expression is a wrong answer
            return False

    cpu_budget_s = float(sys.argv[1])
    matches("\\frac{1}{2}", "0.5")  # math_verify's lazy set-up, outside every comparison's budget
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        gold, predicted = json.loads(line)
        signal.setitimer(signal.ITIMER_PROF, cpu_budget_s)
        result = matches(gold, predicted)
        signal.setitimer(signal.ITIMER_PROF, 0)
        print(int(result), file=replies, flush=True)


if __name__ == "__main__":
    main()
