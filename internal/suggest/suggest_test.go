package suggest

import "testing"

func TestClosest(t *testing.T) {
	keys := []string{"lr", "min_lr", "lr_schedule", "warmup_steps", "weight_decay", "max_grad_norm"}
	for _, tc := range []struct{ name, want string }{
		{"lrr", "lr"},
		{"warmup_step", "warmup_steps"},
		{"wieght_decay", "weight_decay"}, // a transposition
		{"max_grad_nrom", "max_grad_norm"},
		{"learning_rate", ""}, // not a typo of any
		{"beta1", ""},
		{"lr", ""}, // the name itself is no suggestion
	} {
		if got := Closest(tc.name, keys); got != tc.want {
			t.Errorf("Closest(%q) = %q, want %q", tc.name, got, tc.want)
		}
	}
	if got := Closest("trian", []string{"eval", "init", "train", "plan"}); got != "train" {
		t.Errorf("Closest(trian) = %q, want train", got)
	}
}
