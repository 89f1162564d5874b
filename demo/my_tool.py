"""An example `--tool path/to/file.py:function`: the model writes `<factor>360</factor>` and reads
`<result>2^3 * 3^2 * 5</result>` back (docs/tools.md).

    python train.py ... --tool calculator demo/my_tool.py:factor

A tool is a function of one string, the text between its tags, that returns a string, the text
between <result> and </result>. It runs in a worker process of its own (toolbox.py): raising,
hanging past --tool-timeout-s, dying or returning a non-string gives the sample an error text as the
tool's output, and the run goes on. The tag is the function's name.
"""


def factor(text: str) -> str:
    """The prime factors of a whole number from 2 to 10^12: '360' -> '2^3 * 3^2 * 5'."""
    n = int(text.strip())  # a ValueError reaches the model as "error: ValueError: ..."
    if not 2 <= n <= 10**12:
        raise ValueError(f"{n} is not a whole number from 2 to 10^12")
    factors, p = [], 2
    while p * p <= n:
        k = 0
        while n % p == 0:
            n, k = n // p, k + 1
        if k:
            factors.append(f"{p}^{k}" if k > 1 else str(p))
        p += 1
    if n > 1:
        factors.append(str(n))
    return " * ".join(factors)
