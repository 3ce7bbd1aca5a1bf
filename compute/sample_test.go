package compute

import (
	"math"
	"strings"
	"testing"
)

// TestPackUniforms: the pairs give back every uniform bit for bit, the
// largest (1 - 2^-53) and 0 included; a value that is no multiple of
// 2^-53 in [0, 1) is refused.
func TestPackUniforms(t *testing.T) {
	u := []float64{0, 0.5, 0.25 + 1.0/(1<<53), float64(uint64(1)<<53-1) / (1 << 53), float64(0x1234_5678_9abc) / (1 << 53)}
	p := make([]int32, 2*len(u))
	PackUniforms(p, u)
	for i, x := range u {
		if got := Uniform(p[2*i], p[2*i+1]); math.Float64bits(got) != math.Float64bits(x) {
			t.Errorf("uniform %d: %v back as %v", i, x, got)
		}
	}
	for _, bad := range []float64{1, -0.5, 1.0 / (1 << 54), math.NaN()} {
		func() {
			defer func() {
				if r, _ := recover().(string); !strings.Contains(r, "want a multiple of 2^-53 in [0, 1)") {
					t.Errorf("%v: panic %q, want one naming the range", bad, r)
				}
			}()
			PackUniforms(make([]int32, 2), []float64{bad})
		}()
	}
}
