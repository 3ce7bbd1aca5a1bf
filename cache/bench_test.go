package cache

import (
	"fmt"
	"math"
	"sort"
	"testing"
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
