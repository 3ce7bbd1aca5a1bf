package infer

import (
	"errors"
	"fmt"

	"distill/compute"
)

// ActivationBytes bounds what one Forward over tokens tokens (longest
// sample maxLen, top-k) allocates beside the weights: the decoder's
// activations (decoder.Model.ActivationBytes), the host copies of the
// result and of the batch, and the backend's kernel scratch when it
// reports it (compute.ScratchReporter; the CPU backend does). TopK never
// forwards more than Options.TokenBudget tokens at once, so with n =
// TokenBudget and maxLen = min(TokenBudget, MaxPositions), peak RSS <=
// weights + ActivationBytes. The kernel scratch terms are per worker: a
// backend allocates them in its first forward and reuses them after, so
// only that first forward reaches the bound's scratch share.
func (m *Model) ActivationBytes(tokens, maxLen, k int) int64 {
	c := m.Cfg
	n := int64(tokens)
	b := m.d.ActivationBytes(tokens, k)
	b += 4 * 2 * n * int64(k)     // host copies of the top-k (the result)
	b += 4 * (2*n + 1)            // host tokens and starts
	b += 4 * n * int64(c.HeadDim) // host RoPE table before its upload
	if sr, ok := m.be.(compute.ScratchReporter); ok {
		b += sr.AttentionScratchBytes(maxLen) + sr.LMHeadScratchBytes(k)
	}
	if c.NumExperts > 0 {
		// MoE: router logits and choices, plus the routed rows of the
		// busiest expert (at most all n tokens): x, gate, up, y.
		E, K, H, Im := int64(c.NumExperts), int64(c.ExpertsPerTok), int64(c.Hidden), int64(c.MoEIntermediate)
		b += 4 * (n*E + 2*n*K + 2*n*K + n*(2*H+2*Im))
		b += 24 * n * K // per-expert row lists (grown by append: up to 2x)
	}
	return b + 64<<10 // slice headers, goroutines, work items
}

// DeviceBytes bounds the device memory one Forward over tokens tokens
// (top-k; with draws > 0, ForwardDraws drawing that many a position)
// allocates beside the weights on a backend with device memory
// (compute.DeviceMemory): the decoder's activations, which stay on the
// device for the whole forward, the draws' uniforms and results, and the
// kernels' peak scratch. 0 on a backend without device memory.
func (m *Model) DeviceBytes(tokens, maxLen, k, draws int) int64 {
	dm, ok := m.be.(compute.DeviceMemory)
	if !ok {
		return 0
	}
	c := m.Cfg
	s := compute.ForwardShape{Tokens: tokens, MaxLen: maxLen, K: k, Hidden: c.Hidden, Heads: c.Heads, KVHeads: c.KVHeads,
		HeadDim: c.HeadDim, Intermediate: c.Intermediate, Vocab: c.VocabSize, FP8: m.weights == WeightsFP8}
	if c.NumExperts > 0 {
		s.Experts, s.TopK, s.MoEIntermediate = c.NumExperts, c.ExpertsPerTok, c.MoEIntermediate
	}
	var io int64
	if draws > 0 { // the uniforms (two I32 a draw), the drawn ids, the tail mass
		s.Draws = draws
		io = int64(tokens) * (12*int64(draws) + 4)
	}
	return m.d.ActivationBytes(tokens, k) + io + dm.ForwardScratchBytes(s)
}

// deviceReserve is the device memory CheckDeviceFit leaves unplanned: the
// pool's rounding and fragmentation, NVRTC's and cuBLASLt's own
// allocations after start-up: 256 MiB or 2% of the device, the larger.
func deviceReserve(total int64) int64 { return max(256<<20, total/50) }

// CheckDeviceFit checks, on a backend with device memory, that a forward
// of budget tokens (samples of at most maxLen, top-k up to kMax) fits in
// what the device has free once the weights are loaded, so that a budget
// too large for the device is refused at start-up, naming one that fits,
// instead of failing every batch with an out-of-memory error. It runs one
// forward of a single token first: the backend keeps copies of some
// weights from their first use, and MemInfo then counts them. maxDraws >
// 0 plans for fills of sampled targets drawing up to that many a
// position too. nil on a backend without device memory.
func (m *Model) CheckDeviceFit(budget, maxLen, kMax, maxDraws int) error {
	dm, ok := m.be.(compute.DeviceMemory)
	if !ok {
		return nil
	}
	if err := m.firstForward(); err != nil {
		return err
	}
	free, total := dm.MemInfo()
	avail := free - deviceReserve(total)
	need := func(n int) int64 {
		b := m.DeviceBytes(n, min(maxLen, n), kMax, 0)
		if maxDraws > 0 {
			b = max(b, m.DeviceBytes(n, min(maxLen, n), kMax, maxDraws))
		}
		return b
	}
	if need(budget) <= avail {
		return nil
	}
	fits := 0 // the largest budget that fits: need grows with the budget
	for lo, hi := 1, budget-1; lo <= hi; {
		mid := lo + (hi-lo)/2
		if need(mid) <= avail {
			fits, lo = mid, mid+1
		} else {
			hi = mid - 1
		}
	}
	gib := func(b int64) string { return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30)) }
	draws := ""
	if maxDraws > 0 {
		draws = fmt.Sprintf(" and up to %d draws a position", maxDraws)
	}
	msg := fmt.Sprintf("a forward of %d tokens with k up to %d%s needs %s of device memory beyond the weights (activations and kernel scratch), but %s of the device's %s is free after loading them (%s kept in reserve)",
		budget, kMax, draws, gib(need(budget)), gib(max(0, free)), gib(total), gib(deviceReserve(total)))
	if fits == 0 {
		return fmt.Errorf("%w: %s: not even one token fits; use a GPU with more memory, or --device cpu", ErrDeviceMemory, msg)
	}
	return fmt.Errorf("%w: %s: lower --token-budget to %d or less (or lower the largest k, --k-max, or the draws, --max-draws)", ErrDeviceMemory, msg, fits)
}

// ErrDeviceMemory marks a forward size that does not fit the device's
// memory (CheckDeviceFit).
var ErrDeviceMemory = errors.New("infer: the token budget does not fit the device memory")

// firstForward runs a forward of one token, the backend's panic (an
// out-of-memory error from a device the weights leave no room on) turned
// into an error.
func (m *Model) firstForward() (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: the first forward, of one token, failed: %v", ErrDeviceMemory, r)
		}
	}()
	m.Forward([][]int32{{0}}, 1, 1)
	return nil
}
