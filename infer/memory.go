package infer

import "distill/compute"

// ActivationBytes bounds what one Forward over tokens tokens (longest
// sample maxLen, top-k) allocates beside the weights: the decoder's
// activations (decoder.Model.ActivationFloats), the host copies of the
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
	b := 4 * m.d.ActivationFloats(tokens, k)
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
