package infer

import "distill/compute/cpu"

// ActivationBytes bounds what one Forward over tokens tokens (longest
// sample maxLen, top-k) allocates beside the weights on the CPU backend: the
// package doc's formula, term by term. TopK never forwards more than
// Options.TokenBudget tokens at once, so with n = TokenBudget and maxLen =
// min(TokenBudget, MaxPositions), peak RSS <= weights + ActivationBytes.
// The kernel scratch terms are per worker (cpu.Threads of them): a backend
// allocates them in its first forward and reuses them after, so only that
// first forward reaches the bound's scratch share.
func (m *Model) ActivationBytes(tokens, maxLen, k int) int64 {
	c := m.Cfg
	n := int64(tokens)
	H, Hq, Hkv := int64(c.Hidden), int64(c.Heads*c.HeadDim), int64(c.KVHeads*c.HeadDim)
	I := int64(c.Intermediate)
	f := n * (H + H + Hq + 2*Hkv + Hq + H) // x, xn, q, k, v, attn-out, o
	f += 2 * n * I                         // gate, up
	f += 2 * n * int64(k)                  // top-k ids and log-probs on the backend
	f += 2 * n * int64(k)                  // ... and their host copies (the result)
	ints := 2 * 3 * n                      // tokens, positions, starts: host and backend
	b := 4*(f+ints) + cpu.AttentionScratchBytes(maxLen) + cpu.LMHeadScratchBytes(k)
	b += 4 * int64(c.Hidden) // temperature-scaled norm weight
	if c.NumExperts > 0 {
		// MoE: router logits and choices, plus the routed rows of the
		// busiest expert (at most all n tokens): x, gate, up, y.
		E, K, Im := int64(c.NumExperts), int64(c.ExpertsPerTok), int64(c.MoEIntermediate)
		b += 4 * (n*E + 2*n*K + 2*n*K + n*(2*H+2*Im))
		b += 24 * n * K // per-expert row lists (grown by append: up to 2x)
	}
	return b + 64<<10 // slice headers, goroutines, work items
}
