"""SPALM's gradients do not depend on the CPU threads: W learns through the retrieved values
(``gnnlm.spalm.gate``), whose rows many positions share, and the sum of a row's gradients must not
depend on which thread adds first."""
import torch

from gnnlm.spalm.gate import SpalmGate


def test_w_s_gradient_through_the_retrieved_values_is_one_thread_s_on_two_threads():
    """A vocabulary of one word: every retrieved value is W's one row, which both threads add
    into, and every other step of the gradient is exact (products, or sums within one
    position), so two threads must give one thread's gradient bit for bit, on every run."""
    d, n, K = 64, 512, 8
    torch.manual_seed(0)
    gate = SpalmGate(d, gate_bias=0.0)
    with torch.no_grad():
        gate.gate.weight.normal_(0, 0.3)
    W = torch.randn(1, d, requires_grad=True)
    h, upstream = torch.randn(n, d), torch.randn(n, 1)
    values = torch.randint(-1, 1, (n, K))                      # -1: no neighbour

    def w_grad(threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        W.grad = None
        logits, _ = gate(h, values, W.detach(), None, value_weight=W)  # the value path only
        (logits * upstream).sum().backward()
        return W.grad.clone()

    before = torch.get_num_threads()
    try:
        one = w_grad(1)
        differing = sum(not torch.equal(w_grad(2), one) for _ in range(10))
    finally:
        torch.set_num_threads(before)
    assert differing == 0, f"{differing} of 10 runs on two threads gave another gradient of W"
