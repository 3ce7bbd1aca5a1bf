package cache

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"syscall"
	"testing"
	"time"
)

// BenchmarkEncodingSize measures the chunk size per (position, k) entry at
// k=64, V=151936 on the synthetic teacher of package cachetest, the KD-loss
// error of the compact encoding, and bytes per token, for both encodings and
// both id orders. Run:
//
//	go test ./cache -run '^$' -bench EncodingSize -benchtime 1x
func BenchmarkEncodingSize(b *testing.B) {
	for _, idOrder := range []string{"bpe", "random"} {
		for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
			b.Run(fmt.Sprintf("%s/%s", enc, idOrder), func(b *testing.B) {
				gc := makeChunk(b, enc, idOrder, qwenVocab, 64, 16, 512, 7)
				var data []byte
				var out []Sample
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					data, out = roundTrip(b, gc)
				}
				positions := 16 * 512
				b.ReportMetric(float64(len(data))/float64(positions*64), "B/entry")
				b.ReportMetric(float64(len(data))/float64(positions), "B/token")
				exact, pe := kdLoss(gc, func(i int) []float32 { return gc.samples[i].TopKLogProbs })
				dec, pd := kdLoss(gc, func(i int) []float32 { return out[i].TopKLogProbs })
				b.ReportMetric(math.Abs(dec-exact)/exact, "KD-rel-err")
				rel := make([]float64, len(pe))
				for i := range pe {
					rel[i] = math.Abs(pd[i]-pe[i]) / max(pe[i], 1e-9)
				}
				sort.Float64s(rel)
				b.ReportMetric(rel[len(rel)*99/100], "KD-rel-err-p99/pos")
				var top1 float64
				for _, s := range gc.samples {
					for t := range s.Tokens {
						top1 += math.Exp(float64(s.TopKLogProbs[t*64]))
					}
				}
				b.ReportMetric(top1/float64(positions), "mean-top1-p")
			})
		}
	}
}

// BenchmarkReadThroughput measures Iter (read, CRC check, zstd, decode) on a
// compact cache with k=64, V=151936: 8 chunks of 16 samples x 512 tokens of
// the synthetic teacher. Reported as positions/s. Run:
//
//	go test ./cache -run '^$' -bench ReadThroughput -benchtime 5x
func BenchmarkReadThroughput(b *testing.B) {
	gc := makeChunk(b, EncodingCompact, "bpe", qwenVocab, 64, 16, 512, 9)
	dir := b.TempDir()
	m := gc.m
	m.Samples = 8 * 16
	c, err := Create(dir, m, nil)
	if err != nil {
		b.Fatal(err)
	}
	for k := int64(0); k < 8; k++ {
		w, err := c.BeginChunk(k*16, k*16+16)
		if err != nil {
			b.Fatal(err)
		}
		for i, s := range gc.samples {
			s.Index = k*16 + int64(i)
			if err := w.Add(s); err != nil {
				b.Fatal(err)
			}
		}
		if err := w.Commit(); err != nil {
			b.Fatal(err)
		}
	}
	c.Close()
	r, err := OpenReader(dir)
	if err != nil {
		b.Fatal(err)
	}
	var positions int64
	cpu0 := cpuTime()
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		it, err := r.Iter(IterOptions{Seed: uint64(n), Window: 2, ReadAhead: 2})
		if err != nil {
			b.Fatal(err)
		}
		for it.Next() {
			positions += int64(len(it.Sample().Tokens))
		}
		if it.Err() != nil {
			b.Fatal(it.Err())
		}
		it.Close()
	}
	b.StopTimer()
	b.ReportMetric(float64(positions)/b.Elapsed().Seconds(), "positions/s")
	// On a shared machine wall time depends on the neighbours; CPU time
	// (all goroutines: read, CRC, zstd, decode) is the steadier figure.
	b.ReportMetric(float64(positions)/(cpuTime()-cpu0).Seconds(), "positions/cpu-s")
}

// cpuTime returns the user+system CPU time of this process.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

var bigIndex = flag.Bool("cache.big", false, "BenchmarkIndexOpen: 10M samples instead of 1M")

// BenchmarkIndexOpen builds an index of 1M (10M with -cache.big) samples in
// 1000-sample chunks (index only, no chunk files) and measures how long
// OpenReader takes and the Go heap it keeps, and a writer-side index open.
// Run:
//
//	go test ./cache -run '^$' -bench IndexOpen -benchtime 3x -cache.big
func BenchmarkIndexOpen(b *testing.B) {
	n := int64(1_000_000)
	if *bigIndex {
		n = 10_000_000
	}
	const per = 1000
	dir := b.TempDir()
	c, err := Create(dir, testManifest(n, EncodingCompact), nil)
	if err != nil {
		b.Fatal(err)
	}
	c.Close()
	s, err := openIndex(dir, true, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	wb := s.db.NewWriteBatch()
	for a := int64(0); a < n; a += per {
		r := Range{a, a + per}
		for i := a; i < r.End; i++ {
			if err := wb.Set(sampleKey(i), sampleValue(a, uint32(i-a))); err != nil {
				b.Fatal(err)
			}
		}
		rec, _ := json.Marshal(ChunkInfo{Range: r, File: chunkFileName(r), Bytes: 1 << 28, CRC32C: uint32(a), Tokens: per * 2048})
		if err := wb.Set(rangeKey(a), rec); err != nil {
			b.Fatal(err)
		}
	}
	if err := wb.Flush(); err != nil {
		b.Fatal(err)
	}
	if err := s.close(); err != nil {
		b.Fatal(err)
	}
	var disk int64
	filepath.Walk(filepath.Join(dir, indexDir), func(_ string, fi os.FileInfo, _ error) error {
		if fi != nil && !fi.IsDir() {
			disk += fi.Size()
		}
		return nil
	})
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	b.ResetTimer()
	var r *Reader
	for i := 0; i < b.N; i++ {
		r, err = OpenReader(dir)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	// The heap one open reader keeps: measured around a fresh open, after
	// the warm-up opens above have settled.
	r = nil
	runtime.GC()
	runtime.ReadMemStats(&m0)
	r, err = OpenReader(dir)
	if err != nil {
		b.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	if r.Samples() != n {
		b.Fatalf("reader sees %d samples, want %d", r.Samples(), n)
	}
	b.ReportMetric(float64(b.Elapsed().Seconds())/float64(b.N), "open-s")
	b.ReportMetric(float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc))/(1<<20), "reader-heap-MB")
	b.ReportMetric(float64(disk)/(1<<20), "index-disk-MB")
	runtime.GC()
	runtime.ReadMemStats(&m0)
	t0 := time.Now()
	ws, err := openIndex(dir, true, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	runtime.ReadMemStats(&m1)
	ws.close()
	b.ReportMetric(time.Since(t0).Seconds(), "writer-open-close-s")
	b.ReportMetric(float64(int64(m1.HeapAlloc)-int64(m0.HeapAlloc))/(1<<20), "writer-heap-MB")
	runtime.KeepAlive(r)
}
