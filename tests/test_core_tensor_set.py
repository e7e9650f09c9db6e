"""Registered tensor sets (core.tensor_set): the same results as lists, and a set whose tensor
changed since it was registered refused by name with nothing written."""

import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

from gradient_accumulator import core


def _lists(n=5, numel=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    accs = [torch.randn(numel, generator=g) for _ in range(n)]
    grads = [torch.randn(numel, generator=g) for _ in range(n)]
    return accs, grads


def test_accumulate_on_a_set_matches_fp64_and_the_list_call():
    accs, grads = _lists()
    ref = [a.double() + 0.5 * g.double() for a, g in zip(accs, grads)]
    on_list = [a.clone() for a in accs]
    core.accumulate(on_list, grads, weight=0.5)
    s = core.tensor_set(accs)
    r = core.accumulate(s, grads, weight=0.5, compute_sumsq=True)
    for a, b, want in zip(accs, on_list, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), want, rtol=1e-7, atol=1e-7)
    assert r.sumsq == pytest.approx(sum(float((a.double() ** 2).sum()) for a in accs), rel=1e-12)


def test_apply_adamw_adaptive_clip_zero_and_sumsq_on_sets_match_lists():
    accs, grads = _lists(seed=1)
    params = [torch.randn(2, 3) for _ in accs]
    accs = [a.view(2, 3) for a in accs]
    state = [[torch.zeros(2, 3) for _ in accs] for _ in range(2)]
    copies = [[t.clone() for t in ts] for ts in (params, accs, *state)]
    kw = dict(optimizer="adamw", lr=0.1, grad_scale=0.5, weight_decay=0.01, agc=True, step=1)
    core.apply(copies[0], copies[1], state1=copies[2], state2=copies[3], **kw)
    sets = [core.tensor_set(ts) for ts in (params, accs, *state)]
    core.apply(sets[0], sets[1], state1=sets[2], state2=sets[3], **kw)
    for ts, cs in zip((params, accs, *state), copies):
        assert all(torch.equal(t, c) for t, c in zip(ts, cs))
    g2 = [g.view(2, 3).clone() for g in grads]
    g2_list = [g.clone() for g in g2]
    core.adaptive_clip(params, g2_list, clip_factor=0.05)
    read_only = core.tensor_set(params, writable=False)
    core.adaptive_clip(read_only, core.tensor_set(g2), clip_factor=0.05)
    assert all(torch.equal(a, b) for a, b in zip(g2, g2_list))
    assert core.sum_of_squares(sets[0]) == core.sum_of_squares(params)
    core.zero(sets[2])
    assert all(not t.any() for t in state[0])


def test_a_set_holds_its_tensors_weakly_and_refuses_a_freed_one():
    accs, grads = _lists()
    s = core.tensor_set(accs)
    ref = weakref.ref(accs[2])
    before = [a.clone() for a in accs]
    del accs[2]
    gc.collect()
    assert ref() is None and s[2] is None
    with pytest.raises(ValueError, match=r"accumulators\[2\] was freed since its tensor set"):
        core.accumulate(s, grads[:2] + [torch.ones(6)] + grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(accs, before[:2] + before[3:]))


def _resize(t):
    t.resize_(3)


def _set(t):
    t.set_(torch.zeros(6))


def _rebind_data(t):
    t.data = torch.zeros(6)


def _dtype(t):
    t.data = t.data.double()


def _device(t):
    if not torch.cuda.is_available():
        pytest.skip("moving a tensor to another device needs a CUDA device")
    t.data = t.data.cuda()


def _transpose_in_place(t):
    t.data = t.data.view(2, 3).t()


def _storage_freed(t):
    t.untyped_storage().resize_(0)  # what FSDP does to a sharded parameter's storage


def _storage_moved(t):
    t.untyped_storage().resize_(4096)  # a larger allocation: the elements move


def _set_same_storage_transposed(t):
    t.set_(t.untyped_storage(), 0, (3, 2), (1, 3))  # same pointer and count, another layout


def _set_same_storage_shifted(t):
    t.set_(t.untyped_storage(), 1, (5,), (1,))


@pytest.mark.parametrize(
    "change, message",
    [
        (_resize, "was resized from 6 to 3 elements"),
        (_set, "was re-allocated or moved"),
        (_rebind_data, "was re-allocated or moved"),
        (_dtype, "changed dtype from torch.float32 to torch.float64"),
        (_device, "was re-allocated or moved to another device"),
        (_transpose_in_place, "was resized|changed its memory layout"),
        (_storage_freed, "was re-allocated or moved"),
        (_storage_moved, "was re-allocated or moved"),
        (_set_same_storage_transposed, "changed its memory layout"),
        (_set_same_storage_shifted, "was resized from 6 to 5 elements"),
    ],
    ids=[
        "resize_",
        "set_",
        "data=",
        "dtype",
        "device",
        "layout",
        "storage-freed",
        "storage-moved",
        "set_-strides",
        "set_-offset",
    ],
)
def test_a_changed_tensor_is_refused_by_name_and_nothing_is_written(change, message):
    accs, grads = _lists()
    params = [torch.nn.Parameter(torch.randn(6)) for _ in accs]
    plain = [p.detach() for p in params]  # a set holds its tensors weakly: kept here
    sets = core.tensor_set(plain), core.tensor_set(accs)
    kept = [t.detach().clone() for t in params + accs]
    change(accs[3])
    with pytest.raises(ValueError, match=r"accumulators\[3\] " + message) as info:
        core.apply(*sets, optimizer="sgd", lr=0.1)
    assert isinstance(info.value, core.load_core().StaleTensorError)
    for t, k in zip(params + accs, kept):
        if t is not accs[3]:
            assert torch.equal(t.detach(), k)
    with pytest.raises(ValueError, match=r"accumulators\[3\]"):
        core.accumulate(sets[1], grads)


def test_torch_tensors_are_re_checked_by_direct_reads():
    # The fast re-check reads torch's metadata directly; with a torch whose objects it cannot
    # map it falls back to torch's accessors (slower, the same checks). This torch is mapped.
    assert core.load_core()._torch_direct_reads()


def test_direct_reads_can_be_turned_off_and_the_checks_stay():
    # GA_TORCH_DIRECT_READS=0: every re-check goes through torch's accessors, same results and
    # the same refusals. In a child process: the choice is made once per process.
    code = (
        "import torch; from gradient_accumulator import core\n"
        "assert not core.load_core()._torch_direct_reads()\n"
        "accs = [torch.zeros(5) for _ in range(3)]; s = core.tensor_set(accs)\n"
        "g = [torch.full((5,), float(i)) for i in range(3)]\n"
        "core.accumulate(s, g); core.accumulate(s, g)\n"
        "assert all(torch.equal(a, 2 * x) for a, x in zip(accs, g))\n"
        "accs[1].resize_(7)\n"
        "try:\n"
        "    core.accumulate(s, g)\n"
        "except ValueError as e:\n"
        "    assert 'accumulators[1]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('a resized member was read')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, GA_TORCH_DIRECT_READS="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_set_stays_valid_through_in_place_updates_and_autograd_flags():
    accs, grads = _lists()
    params = [torch.nn.Parameter(torch.randn(6)) for _ in accs]
    sets = core.tensor_set(params), core.tensor_set(accs)
    with torch.no_grad():
        for p in params:
            p.mul_(0.5)  # bumps the version counter, moves nothing
    params[1].requires_grad_(False)
    want = [p.detach().double() - 0.1 * a.double() for p, a in zip(params, accs)]
    core.apply(*sets, optimizer="sgd", lr=0.1)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gradients_read_directly_land_where_their_data_pointer_says(dtype):
    # Gradients that are views at offsets into one flat buffer (their data pointer is the
    # storage's plus an offset), of every dtype, as parameters' .grad: the set call equals the
    # list call bit for bit and the fp64 reference.
    g = torch.Generator().manual_seed(5)
    shapes = [(6,), (2, 3), (4, 1, 3), (1,), (3, 5)]
    accs = [torch.randn(s, generator=g) for s in shapes]
    flat = torch.randn(sum(int(np.prod(s)) for s in shapes) + 3, generator=g).to(dtype)
    grads, at = [], 3
    for s in shapes:
        n = int(np.prod(s))
        grads.append(flat[at : at + n].view(s))
        at += n
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for p, gr in zip(params, grads):
        p.grad = gr
    on_list = [a.clone() for a in accs]
    core.accumulate(on_list, [p.grad for p in params], weight=0.25)
    want = [a.double() + 0.25 * gr.double() for a, gr in zip(accs, grads)]
    core.accumulate(core.tensor_set(accs), [p.grad for p in params], weight=0.25)
    for a, b, w in zip(accs, on_list, want):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), w, rtol=1e-7, atol=1e-7)


def test_gradients_that_cannot_be_read_directly_keep_their_refusals():
    accs = [torch.zeros(6), torch.zeros(2, 3)]
    s = core.tensor_set(accs)
    with pytest.raises(TypeError, match=r"grads\[1\] has an unsupported dtype"):
        core.accumulate(s, [torch.ones(6), torch.ones(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"grads\[0\] is not contiguous"):
        core.accumulate(s, [torch.ones(3, 2).t(), torch.ones(2, 3)])
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        core.accumulate(s, [torch.ones(6), torch.ones(3, 3)])
    assert not any(t.any() for t in accs)


def test_a_member_whose_class_changed_is_imported_and_compared():
    class Marked(torch.Tensor):
        pass

    accs = [torch.zeros(4), torch.zeros(4)]
    s = core.tensor_set(accs)
    accs[1].__class__ = Marked  # no longer a plain tensor: not read directly
    core.accumulate(s, [torch.ones(4), torch.full((4,), 2.0)], weight=0.5)
    assert accs[0].tolist() == [0.5] * 4 and accs[1].tolist() == [1.0] * 4
    accs[1].resize_(2)
    with pytest.raises(ValueError, match=r"accumulators\[1\] was resized"):
        core.accumulate(s, [torch.ones(4), torch.ones(4)])


def test_a_numpy_set_is_checked_on_every_call():
    accs = [np.zeros(4, np.float32), np.zeros(4, np.float32)]
    s = core.tensor_set(accs)
    core.accumulate(s, [np.ones(4, np.float32)] * 2, weight=2.0)
    assert accs[1].tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="cannot resize"):
        accs[1].resize(8, refcheck=False)  # NumPy resizes no array that has a weak reference
    del accs[1]
    gc.collect()
    with pytest.raises(ValueError, match=r"accumulators\[1\] was freed"):
        core.accumulate(s, [np.ones(4, np.float32)] * 2)
    assert accs[0].tolist() == [2.0] * 4


def test_registration_checks_like_a_call_and_read_only_sets_are_not_written():
    with pytest.raises(ValueError, match=r"tensors\[1\] is not contiguous"):
        core.tensor_set([torch.zeros(4), torch.zeros(8)[::2]])
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"tensors\[0\] is read-only"):
        core.tensor_set([ro])
    s = core.tensor_set([torch.zeros(3)], writable=False)
    with pytest.raises(ValueError, match="accumulators is a tensor set registered with writable"):
        core.accumulate(s, [torch.ones(3)])
    with pytest.raises(TypeError, match="DLPack capsule"):
        core.tensor_set([torch.utils.dlpack.to_dlpack(torch.zeros(2))])


def test_gradients_beside_a_set_keep_every_check_of_a_list():
    accs = [torch.zeros(6), torch.zeros(6)]
    s = core.tensor_set(accs)
    # A negative-bit view is read with its sign; a strided gradient is refused by name.
    core.accumulate(s, [torch.ones(6)._neg_view(), torch.full((2, 3), 2.0)])
    assert accs[0].tolist() == [-1.0] * 6 and accs[1].tolist() == [2.0] * 6
    with pytest.raises(ValueError, match=r"grads\[1\] is not contiguous"):
        core.accumulate(s, [torch.ones(6), torch.ones(12)[::2]])
    with pytest.raises(TypeError, match=r"grads\[0\] has an unsupported dtype"):
        core.accumulate(s, [torch.ones(6, dtype=torch.int32), torch.ones(6)])
    with pytest.raises(ValueError, match=r"grads\[1\]"):
        core.accumulate(s, [torch.ones(6), torch.ones(5)])
    assert accs[0].tolist() == [-1.0] * 6


# ---- dense layouts other than C order (channels-last) ----


def test_channels_last_tensors_are_one_span_updated_element_for_element():
    g = torch.Generator().manual_seed(3)
    shape = (4, 3, 2, 5)
    p = torch.randn(shape, generator=g)
    a = torch.randn(shape, generator=g)
    m = torch.randn(shape, generator=g).abs()
    want = [t.clone() for t in (p, a, m)]
    core.apply(
        [want[0]],
        [want[1]],
        optimizer="adam",
        lr=0.1,
        state1=[want[2]],
        state2=[want[2].clone()],
        reset=False,
    )
    cl = [t.to(memory_format=torch.channels_last) for t in (p, a, m)]
    core.apply(
        [cl[0]],
        [cl[1]],
        optimizer="adam",
        lr=0.1,
        state1=[cl[2]],
        state2=[cl[2].clone()],
        reset=False,
    )
    for t, w in zip(cl, want):
        assert torch.equal(t, w)  # elementwise: the same arithmetic on each element
    acc = torch.zeros(shape).to(memory_format=torch.channels_last)
    core.accumulate([acc], [cl[1]], weight=2.0)
    assert torch.equal(acc, 2.0 * a)


def test_mixed_layouts_are_refused_naming_the_odd_one():
    a = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"accumulators\[0\] is not contiguous and grads\[0\]"):
        core.accumulate([a], [torch.ones(2, 3, 4, 4)])
    with pytest.raises(ValueError, match=r"grads\[0\] is not contiguous"):
        core.accumulate([torch.zeros(12)], [torch.ones(4, 3).t()])


def test_agc_units_of_a_channels_last_weight_are_its_output_channels():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 3, 3, 3, generator=g)
    gr = torch.randn(6, 3, 3, 3, generator=g) * 10
    want = gr.clone()
    core.adaptive_clip([w], [want], clip_factor=0.02)
    w_cl, g_cl = (t.to(memory_format=torch.channels_last) for t in (w, gr))
    core.adaptive_clip([w_cl], [g_cl], clip_factor=0.02)
    torch.testing.assert_close(g_cl, want, rtol=1e-6, atol=0)
    norms = core.unitwise_norm(w_cl)
    torch.testing.assert_close(
        torch.as_tensor(norms).double(), w.double().flatten(1).norm(dim=1), rtol=1e-6, atol=0
    )
    # A dense layout whose first dimension is not outermost: its units are not spans.
    wt, gt = torch.randn(3, 6).t(), torch.randn(3, 6).t()
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous and its units"):
        core.adaptive_clip([wt], [gt])
    with pytest.raises(ValueError, match=r"tensor is not contiguous and its units"):
        core.unitwise_norm(wt)


def _adam_sets(dtype=torch.float32, n=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(2, 3, generator=g) for _ in range(n)]
    accs = [torch.randn(2, 3, generator=g) for _ in range(n)]
    m1 = [torch.zeros(2, 3, dtype=dtype) for _ in range(n)]
    m2 = [torch.zeros(2, 3, dtype=dtype) for _ in range(n)]
    return params, accs, m1, m2


def test_repeated_apply_on_the_same_sets_matches_lists_bit_for_bit():
    # The second and later calls on one combination of sets skip the core's checks of the
    # lists themselves (checked by the first): every call must still equal the list call.
    on_sets = _adam_sets()
    on_lists = [[t.clone() for t in group] for group in on_sets]
    sets = [core.tensor_set(group) for group in on_sets]
    kw = dict(optimizer="adamw", lr=1e-2, weight_decay=0.1, grad_scale=0.5, reset=False)
    for step in (1, 2, 3):
        core.apply(sets[0], sets[1], state1=sets[2], state2=sets[3], step=step, **kw)
        core.apply(
            on_lists[0], on_lists[1], state1=on_lists[2], state2=on_lists[3], step=step, **kw
        )
    for a, b in zip(sum(on_sets, []), sum(on_lists, [])):
        assert torch.equal(a, b)


def test_sets_that_failed_the_list_checks_are_refused_on_every_call():
    params, accs, _, _ = _adam_sets()
    base = torch.zeros(30)
    overlapping = [base[6 * i : 6 * i + 6].view(2, 3) for i in range(4)]
    overlapping[3] = base[15:21].view(2, 3)  # shares base[15:18] with overlapping[2]
    s_params, s_accs = core.tensor_set(overlapping), core.tensor_set(accs)
    for _ in range(2):
        before = base.clone()
        with pytest.raises(ValueError, match="overlaps"):
            core.apply(s_params, s_accs, optimizer="sgd", lr=0.1, reset=False)
        assert torch.equal(base, before)


def test_sets_checked_for_one_optimizer_are_checked_again_for_another():
    # SGD without momentum reads no state: the state sets, of a dtype Adam refuses (float64
    # state for float32 parameters), pass there, and must still be refused for Adam.
    params, accs, m1, m2 = _adam_sets(dtype=torch.float64)
    sets = [core.tensor_set(group) for group in (params, accs, m1, m2)]
    kw = dict(lr=0.1, reset=False)
    core.apply(sets[0], sets[1], state1=sets[2], state2=sets[3], optimizer="sgd", **kw)
    core.apply(sets[0], sets[1], state1=sets[2], state2=sets[3], optimizer="sgd", **kw)
    before = [t.clone() for t in params + accs + m1 + m2]
    for _ in range(2):
        with pytest.raises(TypeError, match=r"state1\[0\] has dtype float64"):
            core.apply(sets[0], sets[1], state1=sets[2], state2=sets[3], optimizer="adam", **kw)
    assert all(torch.equal(a, b) for a, b in zip(before, params + accs + m1 + m2))


def test_the_remembered_order_of_written_tensors_never_hides_an_overlap():
    # The alias check keeps the sorted order of the last written list it saw. A call with the
    # same written tensors and a gradient that now aliases one of them, or with one written
    # tensor swapped for a view overlapping another, must still be refused, writing nothing.
    accs = [torch.zeros(6) for _ in range(5)]
    grads = [torch.ones(6) for _ in range(5)]
    s_accs = core.tensor_set(accs)
    core.accumulate(s_accs, grads)
    core.accumulate(s_accs, grads)
    for i in (0, 2, 4):
        aliased = list(grads)
        aliased[1] = accs[i]
        before = [a.clone() for a in accs]
        with pytest.raises(ValueError, match=rf"accumulators\[{i}\] overlaps grads\[1\]"):
            core.accumulate(s_accs, aliased)
        assert all(torch.equal(a, b) for a, b in zip(accs, before))
    base = torch.zeros(12)
    swapped = list(accs)
    swapped[3], swapped[1] = base[:6], base[3:9]
    with pytest.raises(ValueError, match=r"accumulators\[(1|3)\] overlaps accumulators\[(1|3)\]"):
        core.accumulate(swapped, grads)
    assert torch.equal(base, torch.zeros(12))
    core.accumulate(s_accs, grads)
    assert all(torch.equal(a, torch.full((6,), 3.0)) for a in accs)
