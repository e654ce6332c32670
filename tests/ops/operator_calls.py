"""How many operator calls a function makes (on a GPU each is a kernel launch, or a view)."""

from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def operator_calls(function, *args, **kwargs) -> int:
    """The operator calls of `function(*args, **kwargs)`."""
    with _Count() as count:
        function(*args, **kwargs)
    return count.calls
