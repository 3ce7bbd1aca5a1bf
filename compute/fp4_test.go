package compute

import "testing"

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
