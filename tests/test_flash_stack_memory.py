"""The flash-attn training stack's activation memory (issue 14): what its fused kernels save for
the backward, counted from their sources, against what autopar's memory model predicts for a
plan made for that software (`flash-attn-2-2023`, `flash-attn-1-2022`).

The stack (github.com/Dao-AILab/flash-attention, flash_attn/, at the FlashAttention-2 release
4f285b35 and the training-code release 4a6eaa9f) runs each GPT layer as two
dropout-add-LayerNorm kernels, a FusedDense q/k/v projection, the FlashAttention kernel, a
FusedDense output projection and a FusedMLP; the loss is its fused cross-entropy. Their
`ctx.save_for_backward`, per layer of b x s tokens, hidden h, a heads (2-byte activations,
`residual_in_fp32`):

- `DropoutAddLayerNormFn` (ops/layer_norm.py), twice: the new residual x (fp32: 4 bytes an
  element; csrc/layer_norm/ln_api.cpp allocates it at the residual's dtype), the dropout mask
  (uint8: 1), mu and rsigma (fp32, one each per row); its output z is the input's dtype;
- `FusedDenseFunc` (ops/fused_dense.py), q/k/v and output projections: its input (z: 2; the
  attention's output: 2, which the attention saves too) and its weight cast to the 2-byte dtype;
- `FlashAttnQKVPackedFunc` (flash_attn_interface.py): q, k, v (views of the packed qkv: 6), the
  output (2), softmax_lse (fp32, one per head and row) and the RNG state (two int64);
- `FusedMLPFunc` at checkpoint_lvl 0 (every config of the runs): its input (z: 2), pre_act (the
  4h pre-activation: 8), output1 (the GELU's output: 8) and both weights cast.

That is 38 bytes an element of b x s x h, 16 bytes a row and 4 bytes a row and head: the same as
what autopar's model prices for the eager ops (autocast's fp32 copy of each LayerNorm input
stands where the fused kernel keeps the fp32 residual; the dropout masks, the 2-byte copies the
projections save, GELU's input and output). So no software field describes the fused
dropout-add-LayerNorm or MLP: a field must change a prediction (`autopar.schema.software`). The
weights' 2-byte copies (the stack keeps fp32 parameters under autocast) are left out here: the
layer's ops save no parameter; the planner adds them per micro-batch where the software keeps fp32
parameters (`SoftwareSpec.param_dtype`, `tests/test_fp32_params.py`).
"""

import pytest
import torch

from autopar.capture import capture
from autopar.models.configs import GPTConfig
from autopar.models.gpt import GPT
from autopar.schema.software import SoftwareSpec, resolve_software
from cost_models.fused_loss import fuse_losses
from cost_models.memory import activation_memory

H, HEADS, S, MB, VOCAB = 64, 4, 32, 2, 128


@pytest.fixture(scope="module")
def graph():
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=S, hidden=H, layers=2, heads=HEADS, dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg).train()
    x = torch.zeros(1, S, dtype=torch.long, device="meta")
    return capture(model, (x, x)).at_batch(MB)


def _layer_saved(g, sw: SoftwareSpec) -> float:
    am = activation_memory(sw.on_graph(g), "bf16", "none", layers=["blocks.0"], device_type="cuda",
                           count_inputs=False, attention_kernel=sw.attention_kernel, autocast=sw.autocast)
    return am.saved_bytes


def _flash_kernels_saved(b: int, s: int, h: int, a: int) -> float:
    """Bytes one layer of the flash-attn stack saves, from the kernels' save_for_backward (module
    docstring; the RNG state's 16 bytes and the weights' casts left out)."""
    elems, rows = b * s * h, b * s
    dropout_add_ln = 4 * elems + 1 * elems + 2 * 4 * rows         # fp32 residual, uint8 mask, mu, rsigma
    qkv_dense = 2 * elems                                         # its input z
    attention = 3 * 2 * elems + 2 * elems + 4 * rows * a          # q, k, v, out, softmax_lse
    out_dense = 0                                                 # its input is the attention's out
    mlp = 2 * elems + 2 * 4 * elems + 2 * 4 * elems               # z, pre_act, output1
    return 2 * dropout_add_ln + qkv_dense + attention + out_dense + mlp


@pytest.mark.parametrize("preset", ["flash-attn-2-2023", "flash-attn-1-2022"])
def test_a_layer_holds_what_the_fused_kernels_save(graph, preset):
    predicted = _layer_saved(graph, SoftwareSpec.load(preset))
    assert predicted == pytest.approx(_flash_kernels_saved(MB, S, H, HEADS), rel=1e-9)


def test_the_default_software_prices_the_same_layer(graph):
    # autopar's runtime runs the eager ops, which save as much as the fused kernels above: the
    # flash-attn presets change a layer's activations by nothing (their loss alone differs)
    assert _layer_saved(graph, resolve_software(None)) == _layer_saved(graph, SoftwareSpec.load("flash-attn-2-2023"))


def test_a_fused_loss_makes_no_per_element_result_in_the_forward():
    # eager cross-entropy writes fp32 log-probabilities beside its input (4 bytes an element of the
    # logits: the forward's worst moment, with a vocabulary large beside the hidden size); the fused
    # kernel (flash-attn csrc/xentropy, host_softmax_xentropy) writes one loss and one log-sum-exp
    # per row, which it saves: nothing of the logits' size is held above what is saved
    cfg = GPTConfig(vocab_size=4096, seq_len=S, hidden=H, layers=1, heads=HEADS, dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg).train()
    x = torch.zeros(1, S, dtype=torch.long, device="meta")
    g = capture(model, (x, x)).at_batch(MB)
    (loss,) = [n for n in g.calls if n.op == "cross_entropy_loss"]
    n = g.node(loss.inputs[0]).outputs[0].numel
    eager = activation_memory(g, "bf16", "none", device_type="cuda", count_inputs=False)
    fused = activation_memory(fuse_losses(g), "bf16", "none", device_type="cuda", count_inputs=False)
    assert eager.forward_over_bytes >= 4 * n
    assert fused.forward_over_bytes < n
