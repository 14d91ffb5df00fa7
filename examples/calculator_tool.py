"""Multi-turn tool use: the model may call a calculator by writing <calc>EXPRESSION</calc>.

    sluiceway run --prompt-data env:arithmetic:2 --custom-generate-function-path examples/calculator_tool.py:generate \\
        --system-prompt "$(python examples/calculator_tool.py --system-prompt)" --apply-chat-template ...

Each time a model turn stops at </calc>, the expression is evaluated (numbers and + - * / ( ) only) and
<result>VALUE</result> is appended as environment tokens: the model sees them, the loss does not train on them.
"""

from __future__ import annotations

import ast
import operator
import sys

SYSTEM_PROMPT = (
    "You can use a calculator: write <calc>EXPRESSION</calc> and you will get <result>VALUE</result>. "
    "Give the final answer as 'The answer is N.'"
)
MAX_TOOL_CALLS = 3
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Arithmetic only: an AST walk, never eval(), so model output cannot run code."""

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("unsupported expression")

    if len(expression) > 200:
        return "error: expression too long"
    try:
        value = walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def generate(ctx, prompt, params):
    buf = ctx.new_buffer(prompt.token_ids)
    for _ in range(MAX_TOOL_CALLS + 1):
        result = await ctx.generate(buf, dict(params, stop=["</calc>"]))
        text = ctx.tokenizer.decode(result.token_ids)
        call = text.rfind("<calc>")
        if result.finish_reason != "stop" or call < 0 or ctx.remaining(buf) <= 0:
            break  # an answer, the length limit, or an abort: the sample is done
        expression = text[call + len("<calc>") :].removesuffix("</calc>")
        suffix = "</calc>" if not text.endswith("</calc>") else ""  # the engine trims a matched stop string
        buf.add_env(ctx.encode(f"{suffix}<result>{calculate(expression)}</result>")[: ctx.remaining(buf)])
    return buf


if __name__ == "__main__" and "--system-prompt" in sys.argv:
    print(SYSTEM_PROMPT)
