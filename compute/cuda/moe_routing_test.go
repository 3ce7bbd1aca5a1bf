package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"distill/compute"
)

// TestMoERoutingWaits: MoERouting's Record, AuxGrad and Later make the
// host wait for nothing, and the snapshot's Read waits once, for its copy
// only (an event; with Options.Pageable, a download of the device copy):
// what lets an MoE training step keep its one wait. Both ways read the
// host's statistics of the same routing bit for bit (counts from the
// offsets, float64 sums t ascending), and AuxGrad writes compute.MoEAuxGrad's
// bits. The conformance suite (MoERouting) checks the values against the
// float64 routing.
func TestMoERoutingWaits(t *testing.T) {
	const T, E, L, coef = 300, 12, 3, 0.0371
	r := rand.New(rand.NewPCG(5, 6))
	probs, offs := make([][]float32, L), make([][]int32, L)
	for l := range probs {
		probs[l] = make([]float32, T*E)
		for i := range probs[l] {
			probs[l][i] = float32(math.Exp(-40 * r.Float64())) // many binades: the sums round
		}
		offs[l] = make([]int32, E+1)
		for e := 1; e <= E; e++ {
			offs[l][e] = offs[l][e-1] + int32(r.IntN(50))
		}
	}
	wantCnt, wantSum, tot := make([][]int, L), make([][]float64, L), make([]int, E)
	for l := range probs {
		wantCnt[l], wantSum[l] = make([]int, E), make([]float64, E)
		for e := 0; e < E; e++ {
			wantCnt[l][e] = int(offs[l][e+1] - offs[l][e])
			tot[e] += wantCnt[l][e]
		}
		for i, v := range probs[l] {
			wantSum[l][i%E] += float64(v)
		}
	}
	wantGrad := compute.MoEAuxGrad(coef, tot, L, T)
	for _, c := range []struct {
		name     string
		pageable bool
		read     string // the one wait of Read
	}{{"staged", false, WaitEvent}, {"pageable", true, WaitDownload}} {
		t.Run(c.name, func(t *testing.T) {
			b := testBackendWith(t, Options{Pageable: c.pageable})
			var saved []*compute.MoESaved
			for l := range probs {
				saved = append(saved, &compute.MoESaved{Probs: b.FromF32(probs[l]), Offsets: b.FromI32(offs[l])})
			}
			dprob := b.New(compute.F32, E)
			rt := b.NewMoERouting(L, E)
			defer rt.Free()
			b.ReadF32(dprob, make([]float32, 1)) // (a synchronization: the uploads are done)
			b.CountHostWaits(true)
			for l := L - 1; l >= 0; l-- { // (any order)
				rt.Record(l, saved[l], T)
			}
			rt.AuxGrad(dprob, coef, T)
			snap := rt.Later()
			if w := b.HostWaits(); len(w) != 0 {
				t.Fatalf("Record, AuxGrad and Later waited: %v, want no wait", w)
			}
			cnt, sum := make([][]int, L), make([][]float64, L)
			for l := range cnt {
				cnt[l], sum[l] = make([]int, E), make([]float64, E)
			}
			snap.Read(cnt, sum)
			if w := waitsOf(b.HostWaits()); w[c.read] != 1 || len(w) != 1 {
				t.Errorf("Read waited %v, want one %s", w, c.read)
			}
			for l := range cnt {
				for e := range cnt[l] {
					if cnt[l][e] != wantCnt[l][e] || math.Float64bits(sum[l][e]) != math.Float64bits(wantSum[l][e]) {
						t.Fatalf("layer %d expert %d: count %d sum %.17g, the host's %d %.17g", l, e, cnt[l][e], sum[l][e], wantCnt[l][e], wantSum[l][e])
					}
				}
			}
			g := make([]float32, E)
			b.ReadF32(dprob, g)
			for e := range g {
				if math.Float32bits(g[e]) != math.Float32bits(wantGrad[e]) {
					t.Fatalf("AuxGrad: expert %d: %g, compute.MoEAuxGrad %g", e, g[e], wantGrad[e])
				}
			}
		})
	}
}

// TestMoEOrder holds k_moe_order to the host's stable counting sort: each
// expert's pairs in ascending order at its offsets, and rowpos the
// inverse, over pair counts below, at and across the kernel's chunks of
// shared memory (4096 pairs), an expert with no pairs, and one with all
// of a chunk.
func TestMoEOrder(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(61, 62))
	for _, c := range []struct{ pairs, E int }{{1, 3}, {600, 5}, {4096, 7}, {3*4096 + 77, 9}, {2*4096 + 4096, 2}} {
		t.Run(fmt.Sprintf("pairs%d_E%d", c.pairs, c.E), func(t *testing.T) {
			sel := make([]int32, c.pairs)
			for i := range sel {
				sel[i] = int32(r.IntN(c.E - 1)) // the last expert gets nothing
			}
			if c.pairs > 4096 {
				for i := 4096; i < 2*4096; i++ {
					sel[i] = 0 // a whole chunk of one expert
				}
			}
			offsets := make([]int32, c.E+1)
			for _, e := range sel {
				offsets[e+1]++
			}
			for e := 0; e < c.E; e++ {
				offsets[e+1] += offsets[e]
			}
			want, wantPos := make([]int32, c.pairs), make([]int32, c.pairs)
			next := append([]int32(nil), offsets[:c.E]...)
			for p, e := range sel {
				want[next[e]], wantPos[p] = int32(p), next[e]
				next[e]++
			}
			order, rowpos := make([]int32, c.pairs), make([]int32, c.pairs)
			func() {
				defer be.enter()()
				ds, do, dord, dpos := be.alloc(int64(c.pairs)*4), be.alloc(int64(c.E+1)*4), be.alloc(int64(c.pairs)*4), be.alloc(int64(c.pairs)*4)
				be.upload(ds, unsafe.Pointer(&sel[0]), int64(c.pairs)*4)
				be.upload(do, unsafe.Pointer(&offsets[0]), int64(c.E+1)*4)
				be.launchKernel(launch{kernel: "k_moe_order", grid: [3]int{c.E, 1, 1}, block: 256}, dptr(ds), dptr(do), int64(c.pairs), dptr(dord), dptr(dpos))
				be.download(unsafe.Pointer(&order[0]), dord, int64(c.pairs)*4)
				be.download(unsafe.Pointer(&rowpos[0]), dpos, int64(c.pairs)*4)
				for _, p := range []uint64{ds, do, dord, dpos} {
					be.free(p)
				}
			}()
			for i := range want {
				if order[i] != want[i] || rowpos[i] != wantPos[i] {
					t.Fatalf("at %d: order %d rowpos %d, want %d and %d", i, order[i], rowpos[i], want[i], wantPos[i])
				}
			}
		})
	}
}
