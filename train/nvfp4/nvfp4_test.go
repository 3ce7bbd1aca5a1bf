package nvfp4

import (
	"errors"
	"math"
	"math/rand"
	"testing"
)

// Hand-derived E4M3 roundings (E4M3FN: 3 mantissa bits, bias 7, subnormals
// k·2^-9, max 448).
func TestE4M3(t *testing.T) {
	for _, c := range []struct{ in, want float32 }{
		{1, 1},
		{1.0625, 1},                  // halfway 1 / 1.125: ties to even mantissa 000
		{1.1875, 1.25},               // halfway 1.125 / 1.25: ties to even mantissa 010
		{1.19, 1.25},                 // above halfway
		{17, 16},                     // quantum 2 in [16,32): halfway 16 / 18 -> 16
		{19, 20},                     // halfway 18 / 20 -> 20
		{448, 448},                   // max normal
		{460, 448},                   // below the 448/480 midpoint
		{470, 448},                   // above it: saturates (satfinite)
		{0.015625, 0.015625},         // 2^-6, smallest normal
		{0.001953125, 0.001953125},   // 2^-9, smallest subnormal
		{0.0009765625, 0},            // 2^-10: halfway 0 / 2^-9 -> 0 (even)
		{0.00146484375, 0.001953125}, // 1.5·2^-10 -> 2^-9
		{0.0029296875, 0.00390625},   // 1.5·2^-9: halfway 1/2 ·2^-9 -> 2·2^-9 (even)
		{-3.3, -3.25},
	} {
		if got := E4M3(c.in); got != c.want {
			t.Errorf("E4M3(%g) = %g, want %g", c.in, got, c.want)
		}
	}
	// Every finite byte decodes and re-encodes to itself.
	for b := 0; b < 256; b++ {
		v := E4M3Value(uint8(b))
		if v != v {
			if b&0x7f != 0x7f {
				t.Errorf("byte %#x decodes to NaN", b)
			}
			continue
		}
		if E4M3(v) != v || (E4M3Byte(v) != uint8(b) && v != 0) {
			t.Errorf("byte %#x -> %g -> %#x", b, v, E4M3Byte(v))
		}
	}
	if E4M3Byte(1) != 0x38 || E4M3Byte(448) != 0x7e || E4M3Byte(0.001953125) != 0x01 {
		t.Errorf("bytes: 1->%#x 448->%#x 2^-9->%#x", E4M3Byte(1), E4M3Byte(448), E4M3Byte(0.001953125))
	}
}

func TestE2M1Ties(t *testing.T) {
	for _, c := range []struct{ in, want float32 }{
		{0, 0}, {0.25, 0}, {0.2500001, 0.5}, {0.75, 1}, {0.7499999, 0.5},
		{1.25, 1}, {1.75, 2}, {2.5, 2}, {2.5000002, 3}, {3.5, 4}, {5, 4}, {5.0000005, 6},
		{6, 6}, {7, 6}, {1e9, 6},
	} {
		if got, _ := E2M1(c.in); got != c.want {
			t.Errorf("E2M1(%g) = %g, want %g", c.in, got, c.want)
		}
	}
}

func fq(x []float32, amax float32) []float32 {
	y := make([]float32, len(x))
	FakeQuant(y, x, 1, len(x), amax)
	return y
}

func eq(t *testing.T, name string, got, want []float32) {
	t.Helper()
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%s[%d] = %g, want %g (got %v)", name, i, got[i], want[i], got)
		}
	}
}

// TestFakeQuantHand: blocks worked out by hand with power-of-two global
// scales, so every intermediate is exact.
func TestFakeQuantHand(t *testing.T) {
	// amax = 2688 -> g = 1. Block max 6 -> sb = 1, s = 1: the E2M1 ties.
	x := []float32{0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6}
	eq(t, "ties", fq(x, 2688), []float32{0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6})

	// Block max 6.375 -> 6.375/6 = 1.0625 -> E4M3 ties to 1 -> s = 1:
	// the max itself saturates at 6.
	x = []float32{6.375, 1.1, -0.3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq(t, "scale tie down", fq(x, 2688), []float32{6, 1, -0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})

	// Block max 7.125 -> 1.1875 -> E4M3 ties up to 1.25 = s:
	// 7.125/1.25 = 5.7 -> 6 -> 7.5; 1.25/1.25 = 1 -> 1.25; 3.125/1.25 = 2.5 -> 2 -> 2.5.
	x = []float32{7.125, 1.25, 3.125, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq(t, "scale tie up", fq(x, 2688), []float32{7.5, 1.25, 2.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})

	// Stale amax: calibrated at 10.5 (g = 2^-8), the block has grown to 21:
	// 21/(6·2^-8) = 896 -> clamped to 448 -> s = 1.75; 21/1.75 = 12 -> 6 ->
	// 10.5 (clipped at the old amax); 3.5/1.75 = 2 -> 3.5.
	x = []float32{21, 3.5, -14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq(t, "stale amax", fq(x, 10.5), []float32{10.5, 3.5, -10.5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})

	// All-zero block: scale 0 -> guard -> 1; output zeros (no NaN).
	x = make([]float32, 16)
	eq(t, "zero block", fq(x, 2688), make([]float32, 16))

	// Guard: g = 2^-20, block max 6·2^-20 -> sb = 1 -> s = 2^-20 < 1e-5 ->
	// s = 1 and the whole block rounds to 0, as in ModelOpt.
	x = []float32{6 * 0x1p-20, 3 * 0x1p-20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
	eq(t, "guard", fq(x, 2688*0x1p-20), make([]float32, 16))

	// Two blocks per row get independent scales; a 20-column row has a
	// short last block of 4.
	x = make([]float32, 20)
	x[0], x[16], x[17] = 6, 0.75, 0.5 // block 2 max 0.75 -> 0.125 -> s = 0.125: 0.75/0.125 = 6, 0.5 -> 4
	want := make([]float32, 20)
	want[0], want[16], want[17] = 6, 0.75, 0.5
	eq(t, "short block", fq(x, 2688), want)
}

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
	for _, amax := range []float32{AbsMax(w), AbsMax(w) / 3, AbsMax(w) * 5} {
		p, err := Pack("w", w, rows, cols, amax)
		if err != nil {
			t.Fatal(err)
		}
		fqw := make([]float32, len(w))
		FakeQuant(fqw, w, rows, cols, amax)
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

func TestQuantizerCalibration(t *testing.T) {
	q := Quantizer{Calibrating: true}
	q.Observe([]float32{1, -3, 2})
	q.Observe([]float32{0.5, 2.5})
	if err := q.Freeze("x"); err != nil || q.Amax != 3 {
		t.Fatalf("amax %g err %v, want 3", q.Amax, err)
	}
	q.Observe([]float32{100})
	if q.Amax != 3 {
		t.Fatalf("frozen amax moved to %g", q.Amax)
	}
	z := Quantizer{Calibrating: true}
	z.Observe(make([]float32, 4))
	if err := z.Freeze("layers.0.mlp.down_proj input"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("zero amax: %v", err)
	}
}
