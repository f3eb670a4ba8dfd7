import torch

from pretrainer.model import Transformer


def test_activation_checkpointing_gives_the_same_gradients():
    from pretrainer.config.schema import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, seq_len=32, d_model=48, n_layer=3, n_head=4, n_kv_head=2))
    idx, targets = torch.randint(0, 97, (2, 32)), torch.randint(0, 97, (2, 32))
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        model.checkpoint_blocks = checkpointed
        _, loss = model(idx, targets)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_activation_checkpointing_saves_less_for_backward():
    from pretrainer.config.schema import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, seq_len=64, d_model=64, n_layer=4, n_head=4))
    idx, targets = torch.randint(0, 97, (4, 64)), torch.randint(0, 97, (4, 64))

    def saved_bytes(checkpointed: bool) -> int:
        model.checkpoint_blocks = checkpointed
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, targets)
        return total

    plain, checkpointed = saved_bytes(False), saved_bytes(True)
    assert checkpointed < 0.5 * plain, (checkpointed, plain)
