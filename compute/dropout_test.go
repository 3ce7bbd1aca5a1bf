package compute

import (
	"math"
	"testing"
)

// TestPhilox4x32 holds Philox4x32 to Random123's known-answer vectors
// (its tests/kat_vectors, philox4x32 with 10 rounds).
func TestPhilox4x32(t *testing.T) {
	for _, c := range []struct {
		ctr [4]uint32
		key [2]uint32
		out [4]uint32
	}{
		{[4]uint32{0, 0, 0, 0}, [2]uint32{0, 0}, [4]uint32{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
		{[4]uint32{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, [2]uint32{0xffffffff, 0xffffffff}, [4]uint32{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
		{[4]uint32{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, [2]uint32{0xa4093822, 0x299f31d0}, [4]uint32{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
	} {
		if got := Philox4x32(c.ctr, c.key); got != c.out {
			t.Errorf("Philox4x32(%08x, %08x) = %08x, want %08x", c.ctr, c.key, got, c.out)
		}
	}
}

// TestDropoutKeepRate: over 2^20 elements of a mask (1024 rows of 1024
// columns), the kept count of each p lies within 5 standard deviations of
// the binomial's mean n(1-p) (a false failure has probability below
// 6e-7), and so does each column phase c%4 (the four words of one
// Philox call) and the agreement of two streams' masks, which independent
// masks make p² + (1-p)². KeepRow is Keep.
func TestDropoutKeepRate(t *testing.T) {
	const rows, cols = 1024, 1024
	within := func(what string, k, n int, q float64) {
		t.Helper()
		mean, sd := float64(n)*q, math.Sqrt(float64(n)*q*(1-q))
		if d := math.Abs(float64(k) - mean); d > 5*sd {
			t.Errorf("%s: %d of %d, want %.0f ± 5·%.1f", what, k, n, mean, sd)
		}
	}
	for _, p := range []float64{0.05, 0.1, 0.5, 0.9} {
		d := NewDropoutMask(0x1234_5678_9abc_def0, 7, 3, p)
		o := NewDropoutMask(0x1234_5678_9abc_def1, 7, 3, p) // another stream
		if want := float32(1 / (1 - p)); d.Scale != want {
			t.Fatalf("p %g: scale %g, want %g", p, d.Scale, want)
		}
		keep, other := make([]bool, cols), make([]bool, cols)
		kept, same := 0, 0
		var phase [4]int
		for r := 0; r < rows; r++ {
			d.KeepRow(r, keep)
			o.KeepRow(r, other)
			for c, k := range keep {
				if k != d.Keep(r, c) {
					t.Fatalf("p %g: KeepRow(%d)[%d] = %v, Keep says otherwise", p, r, c, k)
				}
				if k {
					kept++
					phase[c%4]++
				}
				if k == other[c] {
					same++
				}
			}
		}
		within("kept", kept, rows*cols, 1-p)
		for j, k := range phase {
			within("kept at column phase "+string(rune('0'+j)), k, rows*cols/4, 1-p)
		}
		within("two streams agreeing", same, rows*cols, p*p+(1-p)*(1-p))
	}
	// Rows that end in a partial group of four columns.
	d := NewDropoutMask(99, 4, 2, 0.5)
	for n := 1; n <= 9; n++ {
		keep := make([]bool, n)
		d.KeepRow(3, keep)
		for c, k := range keep {
			if k != d.Keep(3, c) {
				t.Fatalf("KeepRow of %d columns: [%d] = %v, Keep says otherwise", n, c, k)
			}
		}
	}
	if d := NewDropoutMask(1, 1, 1, 0); d.Threshold != 0 || d.Scale != 1 || !d.Keep(5, 9) {
		t.Fatalf("p 0 drops: %+v", d)
	}
}

// BenchmarkDropoutKeepRow draws the mask of rows of 1024 columns (the CPU
// backend's Dropout and DropoutBackward draw each row so) and reports
// millions of elements a second on one goroutine.
//
//	go test ./compute -run '^$' -bench DropoutKeepRow
func BenchmarkDropoutKeepRow(b *testing.B) {
	d := NewDropoutMask(1, 2, 3, 0.1)
	keep := make([]bool, 1024)
	for i := 0; i < b.N; i++ {
		d.KeepRow(i, keep)
	}
	b.ReportMetric(float64(b.N)*1024/b.Elapsed().Seconds()/1e6, "Melem/s")
}
