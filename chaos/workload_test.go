package chaos

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestClient_Write(t *testing.T) {
	t.Run("StaleToken", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusConflict)
			_, _ = io.WriteString(w, `{"type":"urn:redfence:problem:stale-token","title":"t","status":409,"current_fencing_token":0}`)
		}))
		defer srv.Close()
		c := &Client{ID: "c", HTTP: srv.Client()}
		op := c.Write(t.Context(), Link{Base: srv.URL}, "n", 3, []string{"c-1"}, "c-1", false)
		if op.Status != http.StatusConflict || op.Problem != "stale-token" || op.Current == nil || *op.Current != 0 {
			t.Errorf("Write = %d %q current %v; want 409 stale-token current 0", op.Status, op.Problem, op.Current)
		}
	})
}
