package cuda

import (
	"testing"

	"distill/compute"
)

func TestEmuSmoke(t *testing.T) {
	useEmu(t)
	b, err := Open(Options{KernelCache: t.TempDir(), Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	x := b.FromF32([]float32{1, 2, 3})
	y := b.FromF32([]float32{10, 20, 30})
	b.Add(x, y, 3)
	got := make([]float32, 3)
	b.ReadF32(x, got)
	t.Log(got)
	_ = compute.F32
}
