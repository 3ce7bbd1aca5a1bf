package decoder

import (
	"math"
	"testing"

	"distill/compute/device"
	"distill/model"
)

// TestRopeRowsSameAsTable: a packed batch's RoPE table taken from the
// cached rows (each sample's prefix) is ropeTable's, bit for bit, before
// and after the cache grows, for scaled (Llama 3) and plain frequencies.
func TestRopeRowsSameAsTable(t *testing.T) {
	for _, c := range []*model.Config{
		{HeadDim: 128, RopeTheta: 1e6},
		{HeadDim: 64, RopeTheta: 500000, RopeScaling: &model.RopeScaling{Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPos: 8192}},
	} {
		inv, half := c.InvFreq(), c.HeadDim/2
		var r ropeRows
		for _, starts := range [][]int32{{0, 5, 17}, {0, 1, 3000, 3001, 9000}, {0, 40}} {
			n := int(starts[len(starts)-1])
			want, wantS := make([]float32, n*half), make([]float32, n*half)
			ropeTable(want, wantS, starts, inv)
			maxLen := 0
			for s := 0; s+1 < len(starts); s++ {
				maxLen = max(maxLen, int(starts[s+1]-starts[s]))
			}
			rc, rs := r.upTo(maxLen, inv)
			for s := 0; s+1 < len(starts); s++ {
				lo, hi := int(starts[s])*half, int(starts[s+1])*half
				for i := lo; i < hi; i++ {
					if math.Float32bits(rc[i-lo]) != math.Float32bits(want[i]) || math.Float32bits(rs[i-lo]) != math.Float32bits(wantS[i]) {
						t.Fatalf("head_dim %d, starts %v: element %d: cached (%v, %v), ropeTable (%v, %v)", c.HeadDim, starts, i, rc[i-lo], rs[i-lo], want[i], wantS[i])
					}
				}
			}
		}
		if r.n < 5999 {
			t.Fatalf("the cache holds %d rows after a sample of 5999", r.n)
		}
	}
}

// TestUploadRoPEGathered: a batch's cos and sin, gathered on the backend
// from the table kept there (ropeRows.gather), are ropeTable's for its
// packed samples bit for bit, batch after batch as the table grows; Free
// releases the table.
func TestUploadRoPEGathered(t *testing.T) {
	cfg := tinyConfig(model.ArchQwen3)
	be := device.CPU(1)
	m := &Model{Cfg: cfg, be: be}
	inv, half := cfg.InvFreq(), cfg.HeadDim/2
	for _, starts := range [][]int32{{0, 5, 17}, {0, 1, 300, 301, 900}, {0, 40, 41}} {
		n := int(starts[len(starts)-1])
		b := m.upload(make([]int32, n), starts, nil, nil, false)
		want, wantS := make([]float32, n*half), make([]float32, n*half)
		ropeTable(want, wantS, starts, inv)
		got, gotS := make([]float32, n*half), make([]float32, n*half)
		be.ReadF32(b.cos, got)
		be.ReadF32(b.sin, gotS)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) || math.Float32bits(gotS[i]) != math.Float32bits(wantS[i]) {
				t.Fatalf("starts %v: element %d: gathered (%v, %v), ropeTable (%v, %v)", starts, i, got[i], gotS[i], want[i], wantS[i])
			}
		}
		freeAll(be, b.cos, b.sin)
		b.free(be)
	}
	if m.rope.dn < 599 {
		t.Fatalf("the table on the backend holds %d rows after a sample of 599", m.rope.dn)
	}
	m.Free()
	if m.rope.dcos != nil || m.rope.dsin != nil {
		t.Fatal("Free kept the RoPE table")
	}
}
