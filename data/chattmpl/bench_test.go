package chattmpl

import (
	"os"
	"testing"
)

// BenchmarkRenderQwen3 renders a 12-turn conversation with reasoning and a
// tool call through the real Qwen3 template; reports rendered MB/s and
// conversations/s. Run: go test -run XXX -bench Render -benchtime 2s ./data/chattmpl
func BenchmarkRenderQwen3(b *testing.B) {
	benchRender(b, "qwen3.jinja")
}

// BenchmarkRenderLlama31 is the same conversation through Llama 3.1's template.
func BenchmarkRenderLlama31(b *testing.B) {
	benchRender(b, "llama3_1.jinja")
}

func benchRender(b *testing.B, file string) {
	src, err := os.ReadFile("testdata/templates/" + file)
	if err != nil {
		b.Fatal(err)
	}
	tmpl, err := Compile(string(src))
	if err != nil {
		b.Fatal(err)
	}
	msgs := []Message{{Role: "system", Content: "You are a helpful assistant that answers concisely."}}
	for i := 0; i < 5; i++ {
		msgs = append(msgs,
			Message{Role: "user", Content: "Explain the difference between a mutex and a semaphore, with an example in Go please."},
			Message{Role: "assistant", Content: "<think>\nThe user wants a comparison; keep it short.\n</think>\n\nA mutex admits one holder; a semaphore admits N. In Go, sync.Mutex vs a buffered channel of size N."})
	}
	args, _ := ParseJSON([]byte(`{"city": "Paris", "days": 3}`))
	msgs = append(msgs, Message{Role: "assistant", ToolCalls: []any{map[string]any{"type": "function", "function": map[string]any{"name": "weather", "arguments": args}}}})
	opts := Options{AddGenerationPrompt: true, BOSToken: "<|begin_of_text|>"}
	out, err := tmpl.Render(msgs, opts)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(out)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := tmpl.Render(msgs, opts); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "conversations/s")
}

// BenchmarkCompileQwen3 measures parsing the Qwen3 template.
func BenchmarkCompileQwen3(b *testing.B) {
	src, err := os.ReadFile("testdata/templates/qwen3.jinja")
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(src)))
	for i := 0; i < b.N; i++ {
		if _, err := Compile(string(src)); err != nil {
			b.Fatal(err)
		}
	}
}
