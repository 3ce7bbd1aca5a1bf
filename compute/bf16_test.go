package compute

import (
	"math"
	"testing"
)

func TestF32ToBF16RoundsToNearestEven(t *testing.T) {
	cases := []struct {
		in   uint32
		want uint16
	}{
		{0x3f800000, 0x3f80}, // 1.0 exact
		{0x3f808000, 0x3f80}, // halfway, kept bit 0 -> down to even
		{0x3f818000, 0x3f82}, // halfway, kept bit 1 -> up to even
		{0x3f808001, 0x3f81}, // just above halfway -> up
		{0x3f807fff, 0x3f80}, // just below halfway -> down
		{0x7f7fffff, 0x7f80}, // max float rounds to +Inf
		{0xff800000, 0xff80}, // -Inf
		{0x00000001, 0x0000}, // tiny subnormal -> +0
	}
	for _, c := range cases {
		if got := F32ToBF16(math.Float32frombits(c.in)); got != c.want {
			t.Errorf("F32ToBF16(%#08x) = %#04x, want %#04x", c.in, got, c.want)
		}
	}
	if got := F32ToBF16(float32(math.NaN())); BF16ToF32(got) == BF16ToF32(got) {
		t.Errorf("NaN became %#04x, not NaN", got)
	}
}

func TestBF16RoundTripAllValues(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := BF16ToF32(uint16(h))
		if f != f {
			continue
		}
		if got := F32ToBF16(f); got != uint16(h) {
			t.Fatalf("round trip %#04x -> %v -> %#04x", h, f, got)
		}
	}
}

func TestF16ToF32(t *testing.T) {
	cases := map[uint16]float32{
		0x3c00: 1, 0xc000: -2, 0x7bff: 65504, 0x0001: 5.9604645e-08,
		0x3555: 0.33325195, 0x0000: 0,
	}
	for h, want := range cases {
		if got := F16ToF32(h); got != want {
			t.Errorf("F16ToF32(%#04x) = %v, want %v", h, got, want)
		}
	}
	if !math.IsInf(float64(F16ToF32(0xfc00)), -1) {
		t.Error("0xfc00 is not -Inf")
	}
}
