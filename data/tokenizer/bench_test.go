package tokenizer

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// BenchmarkEncode measures Encode throughput on one core on real code (Go's
// net/http/server.go) and prose (the GPL-3 text), and reports next to it
// transformers.js on the same text under node (js-MB/s), the ratio, and HF
// tokenizers' Rust code called from node (hf-rust-MB/s). The node script
// runs once per implementation, model and corpus. To rerun on a quiet
// machine:
//
//	go test ./data/tokenizer -run '^$' -bench Encode -benchtime 2s -cpu 1
func BenchmarkEncode(b *testing.B) {
	for _, model := range []string{"qwen3", "llama3"} {
		for _, c := range []struct{ name, file string }{{"code", "bench_code.go.txt"}, {"prose", "bench_prose.txt"}} {
			b.Run(model+"/"+c.name, func(b *testing.B) {
				tok := loadModel(b, model)
				path := filepath.Join("testdata", c.file)
				raw, err := os.ReadFile(path)
				if err != nil {
					b.Fatal(err)
				}
				text := string(raw)
				ntok := len(tok.Encode(text)) // warms the word cache, as the JS warm-up pass does
				b.SetBytes(int64(len(text)))
				b.ReportAllocs()
				b.ResetTimer()
				for range b.N {
					tok.Encode(text)
				}
				b.StopTimer()
				goMBs := float64(len(text)) * float64(b.N) / b.Elapsed().Seconds() / 1e6
				b.ReportMetric(float64(ntok), "tokens/op")
				js := jsThroughput(b, "tjs", modelDir(b, model), path)
				b.ReportMetric(js, "js-MB/s")
				b.ReportMetric(goMBs/js, "x-vs-js")
				// HF tokenizers (Rust, through napi) for scale; not a target.
				b.ReportMetric(jsThroughput(b, "hf", modelDir(b, model), path), "hf-rust-MB/s")
			})
		}
	}
}

var (
	jsMu    sync.Mutex
	jsCache = map[string]float64{}
)

// jsThroughput runs testdata/bench.js once per (impl, model, corpus).
func jsThroughput(b *testing.B, impl, dir, corpus string) float64 {
	jsMu.Lock()
	defer jsMu.Unlock()
	key := impl + dir + corpus
	if v, ok := jsCache[key]; ok {
		return v
	}
	node, err := exec.LookPath("node")
	if err != nil {
		b.Fatalf("node not found: %s", setupHint)
	}
	out, err := exec.Command(node, filepath.Join("testdata", "bench.js"), impl, dir, corpus, "2").Output()
	if err != nil {
		b.Fatalf("bench.js: %v", err)
	}
	var r struct {
		MBps float64 `json:"mbps"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.MBps <= 0 {
		b.Fatalf("bench.js output %q: %v", out, err)
	}
	jsCache[key] = r.MBps
	return r.MBps
}
