"""The `math` source: synthetic word problems and exercises with random numbers (generated here, not taken from any
benchmark). (Named `maths`, not `math`, so as not to share a name with the standard library's module.)"""

import random
from collections.abc import Iterator

from .records import source_rng, user_record
from .vocabulary import ITEMS, MATH_KINDS, MATH_SUFFIXES, NAMES


def _math_problem(rng: random.Random) -> tuple[str, str]:
    """One synthetic math exercise (kind, text) with random numbers."""
    n = rng.choice(NAMES)
    m = rng.choice([x for x in NAMES if x != n])
    item, items = rng.choice(ITEMS)
    r = rng.randint
    kind = rng.choice(MATH_KINDS)
    if kind == "shop":
        a, p, b, q = r(2, 12), r(1, 9), r(2, 8), r(2, 20)
        t = f"{n} buys {a} {items} at ${p} each and {b} bags of flour at ${q} each. How much does {n} spend in total?"
    elif kind == "share":
        a, k = r(12, 120), r(2, 6)
        t = f"{n} has {a} {items} and gives {k} of them to each of {r(2, 5)} friends. How many {items} are left?"
    elif kind == "speed":
        v, h = r(20, 110), r(2, 9)
        t = f"A train travels at {v} km/h for {h} hours and then at {v + r(5, 30)} km/h for {r(1, 4)} more hours. How far does it travel?"  # noqa: E501
    elif kind == "work":
        a, b = r(2, 12), r(2, 12)
        t = f"{n} can paint a fence in {a} hours and {m} can paint it in {b} hours. How long does it take if they work together?"  # noqa: E501
    elif kind == "percent":
        a, p = r(40, 900), rng.choice([5, 10, 12, 15, 20, 25, 30, 40])
        t = f"A school has {a} students and {p}% of them walk to school. How many students walk to school?"
    elif kind == "interest":
        a, p, y = r(5, 80) * 100, rng.choice([2, 3, 4, 5, 6]), r(2, 10)
        t = f"{n} deposits ${a} at {p}% simple annual interest. How much interest is earned after {y} years? What if the interest were compounded yearly?"  # noqa: E501
    elif kind == "age":
        a, d = r(4, 15), r(2, 5)
        t = f"{n} is {a} years old. {m} is {d} times as old as {n}. How old will {m} be when {n} is {a + r(3, 12)}?"
    elif kind == "area":
        w, h = r(3, 40), r(3, 40)
        t = f"A rectangular garden is {w} m long and {h} m wide. What is its area, and how much fencing is needed to go around it?"  # noqa: E501
    elif kind == "average":
        xs = [r(50, 100) for _ in range(r(3, 6))]
        t = f"{n}'s test scores are {', '.join(map(str, xs))}. What is the average score, and what score is needed on the next test to raise the average by 2 points?"  # noqa: E501
    elif kind == "fraction":
        a, num, den = r(2, 30) * 12, r(1, 3), rng.choice([4, 6, 12])
        t = f"There are {a} {items} in a box. {n} takes {num}/{den} of them and {m} takes half of the rest. How many are left in the box?"  # noqa: E501
    elif kind == "recipe":
        a, s1, s2 = r(1, 5), r(2, 6), r(3, 12)
        t = f"A recipe for {s1} people needs {a} cups of rice. How much rice is needed for {s2} people?"
    elif kind == "savings":
        a, w, g = r(5, 40), r(10, 60), r(200, 1500)
        t = f"{n} saves ${a} a week and already has ${w}. How many weeks until {n} has at least ${g}?"
    elif kind == "ratio":
        a, b, tot = r(1, 7), r(1, 7), r(3, 40) * 10
        t = f"{n} and {m} share ${tot} in the ratio {a}:{b}. How much does each get?"
    elif kind == "linear":
        a, x, b = r(2, 15), r(-20, 20), r(-50, 50)
        t = f"Solve for x: {a}x {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}."
    elif kind == "system":
        x, y, a, b, c, d = r(-9, 9), r(-9, 9), r(1, 6), r(1, 6), r(1, 6), r(-6, -1)
        t = f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and {c}x - {-d}y = {c * x + d * y}."
    elif kind == "quadratic":
        p, q = r(-9, 9), r(-9, 9)
        t = f"Find the roots of x^2 {'-' if p + q >= 0 else '+'} {abs(p + q)}x {'+' if p * q >= 0 else '-'} {abs(p * q)} = 0."  # noqa: E501
    elif kind == "series":
        a, d, k = r(1, 20), r(2, 9), r(10, 60)
        t = f"What is the sum of the first {k} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...?"
    elif kind == "dice":
        s = r(3, 11)
        t = f"Two fair six-sided dice are rolled. What is the probability that the sum is {s}?"
    elif kind == "marbles":
        a, b, c = r(1, 12), r(1, 12), r(1, 12)
        t = f"A bag has {a} red, {b} blue and {c} green marbles. If two are drawn without replacement, what is the probability that both are blue?"  # noqa: E501
    elif kind == "choose":
        a, k = r(5, 15), r(2, 4)
        t = f"In how many ways can a committee of {k} be chosen from {a} people?"
    elif kind == "gcd":
        a, b = r(12, 400), r(12, 400)
        t = f"Find the greatest common divisor and the least common multiple of {a} and {b}."
    elif kind == "arith":
        a, b, c, d = r(2, 99), r(2, 99), r(2, 30), r(2, 9)
        t = f"Calculate ({a} + {b}) * {c} - {a * d} / {d}."
    elif kind == "units":
        a = r(2, 500)
        unit = rng.choice(["kilometres to miles", "pounds to kilograms", "litres to gallons", "inches to centimetres",
                           "minutes to hours and minutes", "square metres to square feet"])  # fmt: skip
        t = f"Convert {a} {unit.split(' to ')[0]} to {unit.split(' to ')[1]}."
    elif kind == "clock":
        h, mi, d = r(1, 12), r(0, 59), r(20, 400)
        t = f"It is {h}:{mi:02d}. What time will it be in {d} minutes?"
    elif kind == "derivative":
        a, b, c = r(1, 9), r(2, 5), r(1, 20)
        t = f"Find the derivative of f(x) = {a}x^{b} + {c}x and evaluate it at x = {r(1, 5)}."
    elif kind == "base":
        a = r(10, 1000)
        t = f"Convert the number {a} to binary and to hexadecimal."
    elif kind == "wage":
        a, h, o = r(12, 40), r(20, 45), r(1, 10)
        t = f"{n} earns ${a} per hour for the first 40 hours a week and 1.5 times that for overtime. How much does {n} earn for a week of {40 + o} hours? And for {h} hours?"  # noqa: E501
    else:  # discount
        p, d = r(20, 400), rng.choice([10, 15, 20, 25, 30, 50])
        t = f"A jacket costs ${p}. It is on sale for {d}% off, and then a 5% tax is added. What is the final price?"
    return kind, t + rng.choice(MATH_SUFFIXES)


def math_prompts(seed: int = 0) -> Iterator[dict]:
    rng = source_rng(seed, "math")
    while True:
        kind, text = _math_problem(rng)
        yield user_record(text, "math", kind)
