package nvfp4

import (
	"errors"
	"math"
	"math/rand"
	"testing"

	"distill/compute"
)

// TestPackRoundTrip: the packed export dequantizes to exactly the fake-
// quantized weights, bit for bit, for fresh and stale amax and zero
// blocks; the nibble order is low = even element.
func TestPackRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	rows, cols := 8, 64
	w := make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(rng.NormFloat64() * 0.05)
	}
	for i := 16; i < 32; i++ {
		w[i] = 0 // an all-zero block
	}
	var wmax float32
	for _, v := range w {
		wmax = max(wmax, float32(math.Abs(float64(v))))
	}
	for _, amax := range []float32{wmax, wmax / 3, wmax * 5} {
		p, err := Pack("w", w, rows, cols, amax)
		if err != nil {
			t.Fatal(err)
		}
		// The fake quantization of every backend is compute's definition,
		// block by block (the conformance suite holds backends to it).
		fqw := make([]float32, len(w))
		for b := 0; b < len(w); b += BlockSize {
			compute.NVFP4FakeQuantBlock(fqw[b:b+BlockSize], w[b:b+BlockSize], GlobalScale(amax))
		}
		d := p.Dequantize()
		for i := range d {
			if math.Float32bits(d[i]) != math.Float32bits(fqw[i]) {
				t.Fatalf("amax %g: element %d dequantizes to %g, fake quant gave %g", amax, i, d[i], fqw[i])
			}
		}
		if p.WeightScale[1] != 0x38 {
			t.Fatalf("zero block scale byte %#x, want E4M3(1.0) = 0x38", p.WeightScale[1])
		}
		if p.WeightScale2 != amax/2688 {
			t.Fatalf("weight_scale_2 %g, want %g", p.WeightScale2, amax/2688)
		}
	}
	// Nibble order by hand: amax 2688 (g = 1), block [1, -6, 0.5, 0, ...]:
	// codes 2, 8|7 = 15, 1, 0 -> bytes 0xF2, 0x01.
	v := make([]float32, 16)
	v[0], v[1], v[2] = 1, -6, 0.5
	p, err := Pack("v", v, 1, 16, 2688)
	if err != nil {
		t.Fatal(err)
	}
	if p.Weight[0] != 0xF2 || p.Weight[1] != 0x01 || p.WeightScale[0] != 0x38 {
		t.Fatalf("packed % x scale %#x, want f2 01 .. and 0x38", p.Weight, p.WeightScale[0])
	}
	// Errors name the tensor.
	if _, err := Pack("q_proj", v, 1, 16, 0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("amax 0: %v", err)
	}
	if _, err := Pack("q_proj", make([]float32, 10), 1, 10, 1); !errors.Is(err, ErrInvalid) {
		t.Fatalf("cols 10: %v", err)
	}
	v[0] = 3 // g = 2^-30: s = 448·2^-30 < 1e-5 -> guard -> s = 1 keeps 3: refuse.
	if _, err := Pack("o_proj", v, 1, 16, 2688*0x1p-30); !errors.Is(err, ErrInvalid) {
		t.Fatalf("guarded block with values: %v", err)
	}
}
