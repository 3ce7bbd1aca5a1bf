package serve

import (
	"context"
	"path/filepath"
	"testing"

	"distill/model"
	pb "distill/proto/distill/v1"
)

// BenchmarkFill measures fill throughput (tokens/s) through a daemon over
// loopback gRPC and with the in-process teacher, on the same model, data
// and chunks. The daemon path should be within 10% of in-process.
//
//	go test ./serve -run '^$' -bench BenchmarkFill -benchtime 3x
func BenchmarkFill(b *testing.B) {
	// Big enough that the forward, not the commit, dominates a chunk:
	// hidden 256, 2 layers, vocab 8192 (~5M parameters).
	mdir := b.TempDir()
	cfg, _ := model.Preset(model.ArchQwen3)
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.Heads, cfg.KVHeads = 8192, 256, 2, 512, 8, 4
	if err := model.WriteCheckpoint(mdir, cfg, model.Init(cfg, model.InitOptions{Seed: 1}), "BF16"); err != nil {
		b.Fatal(err)
	}
	path, all := writeIDsDataset(b, b.TempDir(), 256, 128, 8192, 9)
	var tokens int64
	for _, s := range all {
		tokens += int64(len(s))
	}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	plan := FillPlan{Dataset: ds, ChunkSamples: 64, K: 16}
	run := func(b *testing.B, mk func(cacheDir string) (Worker, func())) {
		for i := 0; i < b.N; i++ {
			b.StopTimer()
			w, stop := mk(b.TempDir())
			b.StartTimer()
			if _, err := RunFill(context.Background(), []Worker{w}, plan); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			stop()
			b.StartTimer()
		}
		b.ReportMetric(float64(tokens)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
	}
	b.Run("in-process", func(b *testing.B) {
		run(b, func(dir string) (Worker, func()) {
			c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: 2048})
			if err != nil {
				b.Fatal(err)
			}
			w := Local(c)
			return w, func() { w.Close() }
		})
	})
	b.Run("daemon", func(b *testing.B) {
		run(b, func(dir string) (Worker, func()) {
			d, err := Start(Config{Model: mdir, Cache: dir, TokenBudget: 2048, Listen: "127.0.0.1:0", Metrics: "off", DataRoots: []string{filepath.Dir(path)}}, nil)
			if err != nil {
				b.Fatal(err)
			}
			w, err := Dial(d.Addr(), DialOptions{})
			if err != nil {
				b.Fatal(err)
			}
			return w, func() { w.Close(); d.Shutdown(context.Background()) }
		})
	})
}
