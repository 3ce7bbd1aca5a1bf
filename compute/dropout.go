package compute

import "math"

// Dropout masks (a LoRA adapter's lora_dropout, see LoRA) come from a
// counter-based generator, Philox4x32-10: an element's bit is a pure
// function of a key and the element's coordinates, never of a generator
// state that advances. So the backward recomputes the forward's mask
// instead of storing it, a recompute (activation checkpointing) sees the
// same mask, a resumed run draws the masks the uninterrupted run drew
// (the key comes from the configuration and the step, which a checkpoint
// holds), and every backend draws the same bits (the conformance suite
// holds each to DropoutMask.Keep).

// Philox4x32 is Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel
// random numbers: as easy as 1, 2, 3", SC 2011; Random123's
// philox4x32_R with R = 10): four 32-bit words from a counter and a key.
// TestPhilox4x32 holds it to Random123's known-answer vectors.
func Philox4x32(ctr [4]uint32, key [2]uint32) [4]uint32 {
	a, b, c, d := philox(ctr[0], ctr[1], ctr[2], ctr[3], key[0], key[1])
	return [4]uint32{a, b, c, d}
}

// philox is Philox4x32 on scalars (the compiler keeps them in registers;
// an array passed round by round made KeepRow several times slower).
func philox(c0, c1, c2, c3, k0, k1 uint32) (uint32, uint32, uint32, uint32) {
	const (
		m0, m1 = 0xD2511F53, 0xCD9E8D57 // PHILOX_M4x32_0, _1
		w0, w1 = 0x9E3779B9, 0xBB67AE85 // PHILOX_W32_0, _1 (the key's bumps)
	)
	for r := 0; r < 10; r++ {
		if r > 0 {
			k0 += w0
			k1 += w1
		}
		p0 := uint64(m0) * uint64(c0)
		p1 := uint64(m1) * uint64(c2)
		c0, c1, c2, c3 = uint32(p1>>32)^c1^k0, uint32(p1), uint32(p0>>32)^c3^k1, uint32(p0)
	}
	return c0, c1, c2, c3
}

// DropoutMask is one inverted-dropout mask over an activation of (rows,
// cols) (torch.nn.Dropout's semantics in training: an element is zeroed
// with probability p, the others are multiplied by 1/(1-p)). Element
// (row r, column c) is kept when
//
//	Philox4x32({c/4, r, Row, Step}, Key)[c%4] >= Threshold
//
// so one Philox call serves four consecutive columns. The rows of the
// activation are the tokens of one packed row of a step (the caller's
// Row); Key names the stream (for a LoRA adapter: the seed, layer and
// module, see train's dropout key), Step the optimizer step.
type DropoutMask struct {
	Key       [2]uint32
	Step, Row uint32
	// Threshold is floor(p·2³²): the probability of a drop is
	// Threshold/2³², p to within 2⁻³².
	Threshold uint32
	// Scale is float32(1/(1-p)), what a kept element is multiplied by
	// (in fp32; a BF16 output is rounded once after).
	Scale float32
}

// NewDropoutMask is the mask of drop probability p (0 <= p < 1) of stream
// key at step and row.
func NewDropoutMask(key uint64, step, row uint32, p float64) DropoutMask {
	return DropoutMask{Key: [2]uint32{uint32(key), uint32(key >> 32)}, Step: step, Row: row,
		Threshold: uint32(min(math.Floor(p*(1<<32)), math.MaxUint32)), Scale: float32(1 / (1 - p))}
}

// Keep reports whether the mask keeps element (row, col).
func (d *DropoutMask) Keep(row, col int) bool {
	w := Philox4x32([4]uint32{uint32(col / 4), uint32(row), d.Row, d.Step}, d.Key)
	return w[col%4] >= d.Threshold
}

// KeepRow sets keep[c] = Keep(row, c) for c < len(keep), one Philox call
// per four columns.
func (d *DropoutMask) KeepRow(row int, keep []bool) {
	t, k0, k1 := d.Threshold, d.Key[0], d.Key[1]
	n := len(keep) &^ 3
	for c := 0; c < n; c += 4 {
		w0, w1, w2, w3 := philox(uint32(c/4), uint32(row), d.Row, d.Step, k0, k1)
		k := keep[c : c+4 : c+4]
		k[0], k[1], k[2], k[3] = w0 >= t, w1 >= t, w2 >= t, w3 >= t
	}
	if n < len(keep) {
		w0, w1, w2, _ := philox(uint32(n/4), uint32(row), d.Row, d.Step, k0, k1)
		for j, w := range [3]uint32{w0, w1, w2} {
			if n+j < len(keep) {
				keep[n+j] = w >= t
			}
		}
	}
}
